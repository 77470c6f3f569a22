"""Penalties and min_tokens: vLLM's formulas, each verify row judged with the drafts before it as
history, and requests decoded under them (greedy and min_tokens end to end; losslessness under
speculation is in test_losslessness.py)."""

from __future__ import annotations

import random

import pytest
import torch
from penalty_reference import penalized_row
from tiny_models import tiny_engine_config

from dspark import LLM, EngineConfig, InvalidParameterError, SamplingParams
from dspark.sampling.penalties import PenaltyState, PenaltyWindow, apply_penalties

VOCAB = 11
EOS = 0


def _window(first_row, num_rows, params, prompt, output, draft_row, stop_ids):
    state = PenaltyState(prompt, output, VOCAB, torch.device("cpu")) if params.penalized else None
    return PenaltyWindow(first_row, num_rows, params, len(output), state, draft_row, stop_ids)


@pytest.mark.parametrize("seed", range(6))
def test_every_verify_row_is_penalized_as_vllm_with_the_drafts_before_it_as_history(seed) -> None:
    rng = random.Random(seed)
    block_size = 4
    num_windows = 5
    drafts = torch.randint(0, VOCAB, (num_windows, block_size))
    windows, expected_rows = [], {}
    logits = torch.randn(40, VOCAB) * 3
    row = 1  # row 0 belongs to no window: it must stay as it is
    for w in range(num_windows):
        params = SamplingParams(
            max_tokens=50,
            presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
            frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
            repetition_penalty=rng.choice([1.0, rng.uniform(0.1, 2)]),
            min_tokens=rng.choice([0, rng.randrange(0, 8)]),
            stop_token_ids=[rng.randrange(VOCAB)],
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
        num_rows = rng.randrange(1, block_size + 2)
        draft_row = w if num_rows > 1 else -1
        stop_ids = sorted({EOS, *params.stop_token_ids})
        windows.append(_window(row, num_rows, params, prompt, output, draft_row, stop_ids))
        for i in range(num_rows):
            history = output + drafts[w, :i].tolist()
            expected_rows[row + i] = penalized_row(logits[row + i], prompt, history, params, stop_ids)
        row += num_rows
    original = logits.clone()
    changed = apply_penalties(logits, windows, drafts)
    for r in range(logits.shape[0]):
        want = expected_rows.get(r, original[r])
        torch.testing.assert_close(logits[r], want.float(), rtol=1e-5, atol=1e-5)
    touched = {r for r, want in expected_rows.items() if not torch.equal(want.float(), original[r])}
    assert touched <= set(changed.tolist() if changed is not None else [])


def test_repetition_counts_the_prompt_and_frequency_only_the_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    state = PenaltyState([0, 1], [2, 2], 5, torch.device("cpu"))
    apply_penalties(logits, [PenaltyWindow(0, 1, params, 2, state, -1, [])], None)
    # 0, 1: prompt only (repetition); 2: output twice (repetition, 2 x frequency, presence); 3, 4: unseen.
    assert logits[0].tolist() == [1.0, -4.0, 1.0 - 1.0 - 0.25, -2.0, 1.0]


def test_min_tokens_masks_stop_ids_only_before_the_min_tokens_th_output_token() -> None:
    logits = torch.zeros(6, 4)
    params = SamplingParams(min_tokens=5, stop_token_ids=[2])
    # 2 tokens committed: rows 0..2 come before the 5th output token, rows 3.. do not.
    window = PenaltyWindow(0, 6, params, 2, None, -1, [0, 2])
    rows = apply_penalties(logits, [window], None)
    assert rows is not None and rows.tolist() == [0, 1, 2]
    assert torch.isinf(logits[:3, [0, 2]]).all() and torch.isfinite(logits[3:]).all()
    assert torch.isfinite(logits[:, [1, 3]]).all()


def _config(target_dir, draft_dir=None, **changes) -> EngineConfig:
    # fp32: compared with the dense fp32 target, also where the engine runs on a GPU
    return tiny_engine_config(target_dir, draft_dir, **{"dtype": "float32", **changes})


PROMPTS = [[3, 5], [1, 2, 3], [7, 7, 7, 7], [4, 6, 2, 1, 5]]


def test_penalties_change_greedy_output(tiny_target_dir) -> None:
    """The tiny target repeats itself; penalties must make it say something else (otherwise the
    losslessness tests of penalized requests would compare nothing)."""
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    penalized = SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=1.0, repetition_penalty=1.5)
    a = llm.generate(params=plain, prompt_token_ids=PROMPTS)
    b = llm.generate(params=penalized, prompt_token_ids=PROMPTS)
    assert all(x.token_ids != y.token_ids for x, y in zip(a, b, strict=True))
    # Presence and repetition penalties make a greedy decoder move on: more distinct tokens.
    assert sum(len(set(o.token_ids)) for o in b) > sum(len(set(o.token_ids)) for o in a)


def test_penalized_greedy_tokens_equal_the_argmax_of_the_penalized_target(tiny_target_dir) -> None:
    from dspark.runner.models.dense import dense_logits
    from dspark.runner.models.loader import load_target_model

    params = SamplingParams(
        max_tokens=12, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.4, min_tokens=6
    )
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    model = load_target_model(tiny_target_dir)
    for prompt, out in zip(PROMPTS, llm.generate(params=params, prompt_token_ids=PROMPTS), strict=True):
        for k, token in enumerate(out.token_ids):
            logits = dense_logits(model, prompt + out.token_ids[:k])[-1]
            row = penalized_row(logits, prompt, out.token_ids[:k], params, [EOS])
            assert token == int(row.argmax())


def test_min_tokens_holds_eos_and_stop_ids_back(tiny_target_dir, tiny_drafter_dir) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2], [7, 1, 3, 3, 5], [3, 5], [6, 6, 1]]
    llm = LLM(_config(tiny_target_dir, tiny_drafter_dir, spec_mode="compact"))
    free = llm.generate(params=SamplingParams(max_tokens=40), prompt_token_ids=prompts)
    held = SamplingParams(max_tokens=40, min_tokens=12, stop_token_ids=[4])
    outs = llm.generate(params=held, prompt_token_ids=prompts)
    assert any(o.finish_reason == "stop" and len(o.token_ids) <= 12 for o in free)  # it would stop early
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        assert EOS not in out.token_ids[:12] and 4 not in out.token_ids[:12]
        assert len(out.token_ids) > 12
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0


def test_stop_strings_match_only_past_min_tokens(tiny_target_dir) -> None:
    llm = LLM(_config(tiny_target_dir, spec_mode="off"))
    prompt = [[3, 5]]
    base = llm.generate(params=SamplingParams(max_tokens=10, ignore_eos=True), prompt_token_ids=prompt)[0]
    first = llm.tokenizer.decode(base.token_ids[:1])
    # The first token's text is a stop string: it stops at once, unless min_tokens lets it pass.
    stopped = llm.generate(
        params=SamplingParams(max_tokens=10, ignore_eos=True, stop=[first]), prompt_token_ids=prompt
    )[0]
    assert stopped.token_ids == base.token_ids[:1] and stopped.finish_reason == "stop"
    held = llm.generate(
        params=SamplingParams(max_tokens=10, ignore_eos=True, stop=[first], min_tokens=3),
        prompt_token_ids=prompt,
    )[0]
    assert held.token_ids[:3] == base.token_ids[:3] and held.text.strip().startswith(first.strip())
    assert len(held.token_ids) > 3 or held.finish_reason == "length"


def test_min_tokens_past_max_tokens_is_rejected_naming_min_tokens() -> None:
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_dict({"max_tokens": 5, "min_tokens": 6})
    assert info.value.field == "min_tokens" and "max_tokens" in str(info.value)
