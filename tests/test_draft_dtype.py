"""`draft_dtype`: the drafter in its own dtype changes speed, never the output."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import tiny_engine_config

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.models import loader
from dspark.runner.models.loader import resolve_draft_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_bf16_only_on_a_cpu_whose_onednn_computes_bf16(monkeypatch) -> None:
    monkeypatch.setattr(loader, "cpu_computes_bf16", lambda: True)
    assert resolve_draft_dtype("auto", CPU, torch.float32) == torch.bfloat16
    assert resolve_draft_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    assert resolve_draft_dtype("auto", CUDA, torch.bfloat16) == torch.bfloat16
    assert resolve_draft_dtype("auto", CUDA, torch.float32) == torch.float32  # the target's, off the CPU
    monkeypatch.setattr(loader, "cpu_computes_bf16", lambda: False)
    assert resolve_draft_dtype("auto", CPU, torch.float32) == torch.float32
    assert resolve_draft_dtype("float32", CPU, torch.bfloat16) == torch.float32
    assert resolve_draft_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16


def test_an_unknown_draft_dtype_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="draft_dtype"):
        EngineConfig(draft_dtype="int8")


@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_greedy_output_equals_plain_decoding_whatever_the_drafter_s_dtype(
    tiny_target_dir, tiny_drafter_dir, draft_dtype
) -> None:
    rng = random.Random()  # fresh prompts each run
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off"))
    expected = [o.token_ids for o in plain.generate(params=params, prompt_token_ids=prompts)]
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, draft_dtype=draft_dtype))
    proposer = llm.engine.proposer
    assert proposer.drafter.fc.weight.dtype == getattr(torch, draft_dtype)
    assert proposer.cache.k.dtype == proposer.draft_head.dtype == getattr(torch, draft_dtype)
    outs = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_stats.drafted_tokens for o in outs) > 0  # it drafted
    plain.engine.close()
    llm.engine.close()
