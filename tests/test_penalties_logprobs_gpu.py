"""Penalties, min_tokens and logprobs on the GPU path (CUDA graphs, in-step drafting, the accept
kernels): the same tokens and log probabilities as the eager engine without speculation (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import gpu_graphs_config

from dspark import LLM, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = 1e-4


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests with and without penalties, min_tokens and logprobs, in one batch."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 12))] for _ in range(8)]
    variants = [
        SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_tokens=40, ignore_eos=True, presence_penalty=0.8, repetition_penalty=1.4, logprobs=0
        ),
        SamplingParams(max_tokens=40, min_tokens=15, frequency_penalty=0.3),
        SamplingParams(max_tokens=40, ignore_eos=True),
    ]
    return prompts, [variants[i % len(variants)] for i in range(len(prompts))]


@pytest.mark.parametrize("spec_mode", ["static", "compact"])
def test_penalized_and_logprob_requests_through_graphs_equal_plain_eager_decoding(
    tiny_target_dir, tiny_drafter_dir, spec_mode
) -> None:
    prompts, params = _requests()
    base = gpu_graphs_config(tiny_target_dir, tiny_drafter_dir, max_num_seqs=16)
    plain = LLM(base.replace(spec_mode="off", cuda_graph_max_tokens=0))
    expected = plain.generate(params=params, prompt_token_ids=prompts)
    plain.engine.close()
    llm = LLM(base.replace(spec_mode=spec_mode))
    assert llm.engine.runner.graphs is not None
    in_step: list[int] = []
    if spec_mode == "static":
        graphs = llm.engine.proposer.graphs
        run_in_step = graphs.run_in_step
        graphs.run_in_step = lambda count: in_step.append(count) or run_in_step(count)
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert llm.engine.runner.graphs.captured, "no step replayed a graph"
    llm.engine.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert sum(o.spec_stats.accepted_tokens for o in outs[1:3]) > 0, "no penalized draft was accepted"
    if spec_mode == "static":
        assert in_step, "no step drafted inside the target step"
    for out, want in zip(outs, expected, strict=True):
        if want.logprobs is None:
            assert out.logprobs is None
            continue
        for a, b in zip(out.logprobs, want.logprobs, strict=True):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < TOLERANCE and a[t].rank == b[t].rank for t in a)


def test_seeded_penalized_sampling_replays_on_the_gpu(tiny_target_dir, tiny_drafter_dir) -> None:
    config = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(tiny_drafter_dir),
        device="cuda",
        dtype="float32",
        spec_mode="static",
        adaptive_speculation=False,
    )
    params = [
        SamplingParams(
            max_tokens=32, temperature=0.9, seed=s, presence_penalty=0.5, repetition_penalty=1.2, logprobs=1
        )
        for s in range(6)
    ]
    llm = LLM(config)
    first = llm.generate(params=params, prompt_token_ids=[[3, 5, 1]] * 6)
    again = llm.generate(params=params, prompt_token_ids=[[3, 5, 1]] * 6)
    llm.engine.close()
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.logprobs) == len(o.token_ids) for o in first)
    assert sum(o.spec_stats.accepted_tokens for o in first) > 0
