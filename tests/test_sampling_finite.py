"""The sampler never turns a NaN or inf distribution into a token: that request alone fails."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dspark.sampling.sampler as sampling
import dspark.spec.accept as accept
from dspark import LLM, EngineConfig, SamplingParams
from dspark.sampling.sampler import NON_FINITE_TOKEN, choose_tokens, filtered_probs
from dspark.spec.accept import rejection_accept_all

VOCAB = 32
SAMPLED = SamplingParams(temperature=1.0, seed=1)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=1e-46),
        SamplingParams(temperature=1.0, top_p=5e-324),
        SamplingParams(temperature=1e-5),
        SamplingParams(temperature=1e-5, top_k=3, top_p=0.5),
        SamplingParams(temperature=100.0),
    ],
    ids=[
        "top_p_1e-46",
        "top_p_5e-324",
        "temperature_1e-5",
        "temperature_1e-5_top_k_top_p",
        "temperature_100",
    ],
)
def test_extreme_sampling_values_give_a_finite_distribution(params) -> None:
    logits = _logits(4)
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))


def test_a_tiny_top_p_samples_the_most_likely_token() -> None:
    logits = _logits(8)
    tokens = choose_tokens(logits, SamplingParams(temperature=1.0, top_p=1e-46), torch.Generator())
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_of_broken_logits_gives_no_token(bad) -> None:
    logits = _logits(3)
    logits[1, :] = bad
    tokens = choose_tokens(logits, SAMPLED, torch.Generator().manual_seed(1)).tolist()
    assert tokens[1] == NON_FINITE_TOKEN
    assert all(0 <= t < VOCAB for i, t in enumerate(tokens) if i != 1)


def test_rejection_sampling_fails_only_the_request_whose_distribution_is_not_finite() -> None:
    drafts = [[1, 2], [3], [4, 5]]
    draft_probs = [torch.softmax(_logits(2, seed=i), -1) for i in range(3)]
    target = [_logits(len(d) + 1, seed=10 + i) for i, d in enumerate(drafts)]

    def judge(target_logits: list[torch.Tensor], probs: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        generators = [torch.Generator().manual_seed(7 + i) for i in range(3)]
        return rejection_accept_all(drafts, probs, target_logits, [SAMPLED] * 3, generators, 2)

    clean_accepted, clean_tokens = judge(target, draft_probs)
    assert NON_FINITE_TOKEN not in clean_tokens
    broken_target = [t.clone() for t in target]
    broken_target[1][0, 5] = float("nan")
    accepted, tokens = judge(broken_target, draft_probs)
    assert tokens == [clean_tokens[0], NON_FINITE_TOKEN, clean_tokens[2]]
    assert accepted[0] == clean_accepted[0] and accepted[2] == clean_accepted[2]
    broken_draft = [p.clone() for p in draft_probs]
    broken_draft[2][1, 0] = float("inf")
    _, tokens = judge(target, broken_draft)
    assert tokens == [clean_tokens[0], clean_tokens[1], NON_FINITE_TOKEN]


def _nan_for(victim_top_k: int, real: Callable) -> Callable:
    """`real` (filtered_probs or filtered_probs_of_requests) with NaN in the rows of requests whose top_k
    is victim_top_k."""

    def filtering(logits, params) -> torch.Tensor:
        probs = real(logits, params)
        if isinstance(params, SamplingParams):
            return probs.fill_(float("nan")) if params.top_k == victim_top_k else probs
        start = 0
        for rows, p in zip(logits, params, strict=True):
            if p.top_k == victim_top_k:
                probs[start : start + rows.shape[0]] = float("nan")
            start += rows.shape[0]
        return probs

    return filtering


@pytest.mark.parametrize("where", ["first_token", "verify"])
def test_the_engine_fails_a_request_with_broken_logits_and_serves_the_others(
    tiny_target_dir, tiny_drafter_dir, monkeypatch, where
) -> None:
    victim = SamplingParams(max_tokens=12, temperature=1.0, top_k=7, seed=3, ignore_eos=True)
    healthy = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
    config = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(tiny_drafter_dir),
        num_kv_pages=64,
        kv_page_size=4,
        adaptive_speculation=False,
    )
    llm = LLM(config)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    alone = llm.generate(params=healthy, prompt_token_ids=prompts[1:])[0]
    if where == "first_token":  # the prompt's last row, sampled by choose_tokens
        monkeypatch.setattr(sampling, "filtered_probs", _nan_for(victim.top_k, sampling.filtered_probs))
    else:  # the verify windows, judged by rejection sampling
        real = accept.filtered_probs_of_requests
        monkeypatch.setattr(accept, "filtered_probs_of_requests", _nan_for(victim.top_k, real))
    failed, served = llm.generate(params=[victim, healthy], prompt_token_ids=prompts)
    assert failed.finish_reason == "error"
    assert (where == "first_token") == (failed.token_ids == [])
    assert all(0 <= t < 8 for t in failed.token_ids)
    assert (served.finish_reason, served.token_ids) == ("length", alone.token_ids)
    assert not llm.engine.has_unfinished_requests()
