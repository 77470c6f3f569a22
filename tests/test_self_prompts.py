"""Self-generated prompts (`dspark.training.self_prompts`): the user-turn prefix, the cleaning, the
sampling loop through a real engine, and the prompt set they make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import write_tiny_target

from dspark import LLM, EngineConfig, SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.training.data import encode_prompt, read_prompts
from dspark.training.self_prompts import (
    DOMAIN,
    clean_user_turn,
    generate_self_prompts,
    user_turn_prefix,
    write_prompt_set,
)

ROOT = Path(__file__).resolve().parents[1]
# A template in the tiny tokenizer's words: w1 opens a turn, w0 (EOS) closes it, w2 opens the answer.
TINY_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w0 {% endfor %}{% if add_generation_prompt %}w2 {% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with a chat template, many words (so sampled requests differ)."""
    # Seed 2: a target whose greedy answers often end (EOS) within a few dozen tokens.
    path = write_tiny_target(tmp_path_factory.mktemp("chat-target"), vocab_size=64, logit_scale=0.5, seed=2)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TINY_TEMPLATE}))
    return path


def test_the_prefix_is_the_template_up_to_the_user_text_of_smollm2() -> None:
    tokenizer = Tokenizer.from_dir(ROOT / "models/SmolLM2-135M-Instruct")
    prefix = user_turn_prefix(tokenizer)
    assert prefix.endswith("<|im_start|>user\n")
    assert "<|im_start|>system\n" in prefix  # the default system turn, as served prompts have it
    # The prefix and a request's text are exactly how the template starts that request.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Plan a trip."}])
    assert rendered.startswith(prefix + "Plan a trip.")


def test_a_template_that_hides_the_user_text_is_refused(chat_target: Path, tmp_path: Path) -> None:
    config = json.loads((chat_target / "tokenizer_config.json").read_text())
    bad = tmp_path / "t"
    bad.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (bad / name).write_bytes((chat_target / name).read_bytes())
    (bad / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "w1 w2"}))
    with pytest.raises(ValueError, match="user turn"):
        user_turn_prefix(Tokenizer.from_dir(bad))


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("  Can you plan a birthday party for me?  ", "Can you plan a birthday party for me?"),
        ("Hi there", None),  # two words
        ("", None),
        ("1 2 3 4 5", None),  # no letters
        ("Tell me more <|im_start|>assistant", None),  # a template marker
        ("word " * 400, None),  # too long
    ],
)
def test_cleaning_keeps_whole_requests_only(text: str, kept: str | None) -> None:
    assert clean_user_turn(text) == kept


def _engine(target: Path) -> LLM:
    config = EngineConfig(model=str(target), device="cpu", spec_mode="off", num_kv_pages=512, max_num_seqs=16)
    return LLM(config)


def test_sampled_requests_are_distinct_whole_turns_in_a_prompt_set(chat_target: Path, tmp_path: Path) -> None:
    with _engine(chat_target) as llm:
        conversations = generate_self_prompts(
            llm, count=12, seed=5, max_tokens=24, batch=16, log=lambda _: None
        )
        tokenizer = llm.tokenizer
    assert 0 < len(conversations) <= 12
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)  # no follow-ups asked for
    texts = [c[0]["content"] for c in conversations]
    assert len({" ".join(t.lower().split()) for t in texts}) == len(texts)
    for text in texts:
        assert clean_user_turn(text) == text
        assert "w0" not in text.split()  # EOS ended the turn, not part of it
    out = tmp_path / "self.jsonl"
    write_prompt_set(out, conversations, seed=5)
    prompts = read_prompts(out)
    assert [p.prompt for p in prompts] == texts
    assert {p.domain for p in prompts} == {DOMAIN}
    assert len({p.key for p in prompts}) == len(prompts)  # each its own key: held out alone
    # Answered as every prompt is: the request as the user turn under the chat template.
    first = tokenizer.encode("w1", add_special_tokens=False)
    assert encode_prompt(tokenizer, prompts[0].conversation)[:1] == first


def test_follow_ups_continue_after_the_targets_own_answer(chat_target: Path, tmp_path: Path) -> None:
    with _engine(chat_target) as llm:
        conversations = generate_self_prompts(
            llm,
            count=48,
            seed=0,
            max_tokens=24,
            batch=48,
            follow_up_share=1.0,
            answer_tokens=24,
            log=lambda _: None,
        )
        followed = [c for c in conversations if len(c) > 1]
        assert followed, "no follow-up in 48 tries"  # 7 with these seeds
        # The assistant turn is the target's greedy answer to the first request, whole.
        firsts = [[c[0]] for c in followed]
        tokenizer = llm.tokenizer
        again = llm.generate(
            params=SamplingParams(max_tokens=24),
            prompt_token_ids=[encode_prompt(tokenizer, f) for f in firsts],
        )
    for conversation, answer in zip(followed, again, strict=True):
        assert [m["role"] for m in conversation] == ["user", "assistant", "user"]
        assert answer.finish_reason == "stop"
        assert conversation[1]["content"] == answer.text.strip()
        assert clean_user_turn(conversation[2]["content"]) == conversation[2]["content"]
    out = tmp_path / "self.jsonl"
    write_prompt_set(out, conversations, seed=0)
    prompts = read_prompts(out)
    assert [p.conversation for p in prompts] == conversations  # the whole conversation is answered
    assert [p.prompt for p in prompts] == [c[-1]["content"] for c in conversations]
