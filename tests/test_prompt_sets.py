"""The committed prompt sets (training/prompts_{train,eval}.jsonl, built by training/build_prompts.py) are
well formed, held out by source, balanced and small enough to travel; readers send a multi-turn prompt
as its whole conversation."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dspark.prompts import check_prompt
from dspark.sampling_params import SamplingParams
from dspark.tokenizer import Tokenizer
from dspark.training.data import encode_prompt, read_prompts

TRAINING = Path(__file__).resolve().parents[1] / "training"
DOMAINS = {"chat", "code", "prose", "math"}
FIELDS = ("id", "domain", "prompt", "source", "key", "kind")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _records(side: str) -> list[dict]:
    with (TRAINING / f"prompts_{side}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def train() -> list[dict]:
    return _records("train")


@pytest.fixture(scope="module")
def evaluation() -> list[dict]:
    return _records("eval")


def _text(record: dict) -> str:
    """The whole prompt: its conversation when it has one."""
    return json.dumps(record.get("messages") or record["prompt"])


def test_every_record_has_the_fields_and_one_of_four_domains(train, evaluation) -> None:
    for record in train + evaluation:
        assert all(isinstance(record[f], str) and record[f] for f in FIELDS), record
        assert record["domain"] in DOMAINS
    assert {r["domain"] for r in train} == {r["domain"] for r in evaluation} == DOMAINS
    assert len({r["id"] for r in train + evaluation}) == len(train) + len(evaluation)


def test_evaluation_set_has_100_prompts_per_domain(evaluation) -> None:
    assert Counter(r["domain"] for r in evaluation) == dict.fromkeys(DOMAINS, 100)


def test_no_source_unit_and_no_prompt_on_both_sides(train, evaluation) -> None:
    assert not {r["key"] for r in train} & {r["key"] for r in evaluation}
    assert not {_text(r) for r in train} & {_text(r) for r in evaluation}
    assert len({_text(r) for r in train}) == len(train)


def test_multi_turn_prompts_alternate_and_end_with_the_user(train, evaluation) -> None:
    multi = [r for r in train + evaluation if "messages" in r]
    assert len(multi) > 1000
    assert {r["domain"] for r in multi} >= {"chat", "math"}
    for record in multi:
        messages = record["messages"]
        assert len(messages) >= 3 and len(messages) % 2 == 1
        for i, message in enumerate(messages):
            assert set(message) == {"role", "content"} and message["content"].strip()
            assert message["role"] == ("user" if i % 2 == 0 else "assistant")
        assert record["prompt"] == messages[-1]["content"]


def test_training_mix_is_balanced_across_domains_and_languages(train) -> None:
    domains = Counter(r["domain"] for r in train)
    for domain, share in {"chat": 0.3, "code": 0.3, "prose": 0.2, "math": 0.2}.items():
        assert abs(domains[domain] / len(train) - share) < 0.03, domains
    languages = Counter(r["kind"].split("/")[1] for r in train if r["domain"] == "code")
    assert len(set(languages) - {"python"}) >= 4
    assert languages["python"] <= domains["code"] / 3
    # No single source unit dominates: the largest key has under 1% of the prompts.
    assert max(Counter(r["key"] for r in train).values()) < len(train) / 100


def test_training_file_fits_the_size_budget() -> None:
    assert (TRAINING / "prompts_train.jsonl").stat().st_size <= 12 * 2**20


def test_manifest_counts_match_the_files(train, evaluation) -> None:
    manifest = json.loads((TRAINING / "prompts_manifest.json").read_text())
    for side, records in (("train", train), ("eval", evaluation)):
        counts = Counter(r["domain"] for r in records)
        assert {d: manifest["counts"][side][d]["written"] for d in DOMAINS} == counts
    assert all(p["version"] and p["licence"] for p in manifest["debian_packages"].values())


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny byte-level BPE with a ChatML template."""
    root = tmp_path_factory.mktemp("chat_tokenizer")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(["What does it mean? user assistant"] * 3, trainer=trainer)
    hf.save(str(root / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(root)


def test_a_multi_turn_prompt_is_encoded_as_its_whole_conversation(chat_tokenizer, tmp_path) -> None:
    messages = [
        {"role": "user", "content": "Tell me a quote about work."},
        {"role": "assistant", "content": "Work expands to fill the time available."},
        {"role": "user", "content": "What does it mean?"},
    ]
    path = tmp_path / "prompts.jsonl"
    rows = [
        {
            "id": "a",
            "domain": "chat",
            "prompt": "What does it mean?",
            "source": "s",
            "key": "k",
            "kind": "c/m",
            "messages": messages,
        },  # fmt: skip
        {"id": "b", "domain": "math", "prompt": "What is 2 + 2?", "source": "s", "key": "j", "kind": "m/a"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    multi, single = read_prompts(path)

    rendered = chat_tokenizer.decode(encode_prompt(chat_tokenizer, multi.conversation), False)
    assert rendered.count("<|im_start|>user") == 2 and "Work expands to fill" in rendered
    assert rendered.endswith("What does it mean?<|im_end|>\n<|im_start|>assistant\n")
    assert encode_prompt(chat_tokenizer, single.conversation) == encode_prompt(chat_tokenizer, single.prompt)
    assert (
        chat_tokenizer.decode(encode_prompt(chat_tokenizer, single.prompt), False).count("<|im_start|>") == 2
    )


def test_a_raw_prompt_is_encoded_as_the_server_encodes_a_text_request(chat_tokenizer: Tokenizer) -> None:
    # The raw form is what a text_input request becomes in the server, template-free.
    question = "What does it mean?"
    served = check_prompt(question, None, SamplingParams(), chat_tokenizer, 300, 1024)
    assert encode_prompt(chat_tokenizer, question, "raw") == served
    assert "<|im_start|>" not in chat_tokenizer.decode(served, False)
    turns = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "No."}]
    assert chat_tokenizer.decode(encode_prompt(chat_tokenizer, turns, "raw"), False) == "Tell me.\n\nNo."
    with pytest.raises(ValueError, match="prompt form"):
        encode_prompt(chat_tokenizer, question, "markdown")
