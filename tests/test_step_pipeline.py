"""The step is a sequence of frozen values, and the runner hands back the drafts it made itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.config import EngineConfig
from dspark.engine.scheduler import PrefillChunk, StepSchedule
from dspark.engine.step import Acceptance, Committed, PackedStep, WindowAcceptance
from dspark.runner.cuda_graphs import CudaGraphs
from dspark.runner.model_runner import ModelRunner, TargetResult, TargetStep
from dspark.spec.drafts import Drafts
from dspark.spec.step_draft import InStepDrafts
from dspark.spec.verify_policy import VerifyPlan

PAGE = 4
STAGE_VALUES = [
    StepSchedule,
    PrefillChunk,
    Drafts,
    InStepDrafts,
    VerifyPlan,
    PackedStep,
    TargetStep,
    TargetResult,
    WindowAcceptance,
    Acceptance,
    Committed,
]


@pytest.mark.parametrize("value", STAGE_VALUES, ids=[v.__name__ for v in STAGE_VALUES])
def test_every_stage_value_is_frozen(value) -> None:
    # A frozen dataclass, or a named tuple (the values made per request and step, for their speed).
    if issubclass(value, tuple):
        assert hasattr(value, "_fields")
        made = value(*range(len(value._fields)))
        with pytest.raises(AttributeError):
            setattr(made, value._fields[0], "changed")
    else:
        assert dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen


class _DraftsMadeWhilePacking:
    """A VerifyDrafts whose drafts are made when the runner packs them: [anchor, 6, 4] for one window."""

    num_windows = 1

    def __init__(self) -> None:
        self.packed_in_layout: list[bool] = []

    def pack(
        self, token_ids: torch.Tensor, window_lens: list[int], out: torch.Tensor, in_layout: bool
    ) -> str:
        self.packed_in_layout.append(in_layout)
        out[1:3] = torch.tensor([6, 4], device=out.device)
        return "the drafts made"


def test_the_runner_packs_drafts_made_in_the_step_and_hands_them_back(tiny_target_dir) -> None:
    config = EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, kv_page_size=PAGE)
    runner = ModelRunner.create(config, torch.device("cpu"), torch.float32)

    def step(token_ids: list[int], drafts: _DraftsMadeWhilePacking | None) -> TargetStep:
        # A verify window of 3 tokens after 2 cached ones, then a prefill chunk of 2.
        return TargetStep(
            token_ids=torch.tensor(token_ids),
            positions=None,
            window_starts=[2, 0],
            window_lens=[3, 2],
            pages=[[0, 2], [1]],
            logit_rows=torch.arange(5),
            capture_layers=(),
            drafts=drafts,
        )

    complete = runner.run(step([3, 6, 4, 5, 1], None))
    assert complete.drafts is None
    drafts = _DraftsMadeWhilePacking()
    eager = runner.run(step([3, 0, 0, 5, 1], drafts))
    runner.use_graphs(CudaGraphs(runner.model, runner.cache, runner.device, 8, 2, emulate=True))
    replayed = runner.run(step([3, 0, 0, 5, 1], drafts))
    assert drafts.packed_in_layout == [False, True]
    for result in (eager, replayed):
        assert result.drafts == "the drafts made"
        torch.testing.assert_close(result.logits, complete.logits)


def test_logits_stay_in_the_model_dtype_while_every_request_decides_by_argmax(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    # bf16 on the CPU: a greedy-only step's logits are not converted (the argmax reads the same
    # values); once a sampling request is in the engine, steps convert them to fp32 for it.
    from dspark import LLM, SamplingParams

    config = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(tiny_drafter_dir),
        spec_mode="static",
        dtype="bfloat16",
        device="cpu",
        num_kv_pages=64,
        kv_page_size=PAGE,
        adaptive_speculation=False,
    )
    llm = LLM(config)
    runner = llm.engine.runner
    seen: list[tuple[bool, torch.dtype]] = []
    run = runner.run

    def recording_run(step: TargetStep) -> TargetResult:
        result = run(step)
        assert result.logits is not None
        seen.append((step.fp32_logits, result.logits.dtype))
        return result

    runner.run = recording_run
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    outs = llm.generate(params=greedy, prompt_token_ids=prompts)
    assert seen and set(seen) == {(False, torch.bfloat16)}
    seen.clear()
    sampled = SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=3)  # ends last
    llm.generate(params=[greedy, sampled], prompt_token_ids=prompts)
    assert seen and set(seen) == {(True, torch.float32)}
    # The same greedy tokens as steps that convert: the argmax of bf16 logits and of their exact fp32
    # copies agree.
    logits = torch.randn(64, 1000).to(torch.bfloat16)
    assert torch.equal(logits.argmax(dim=-1), logits.float().argmax(dim=-1))
    runner.run = run
    again = llm.generate(params=[greedy, sampled], prompt_token_ids=prompts)
    assert again[0].token_ids == outs[0].token_ids
