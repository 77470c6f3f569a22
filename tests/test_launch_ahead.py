"""launch_ahead: with overlap scheduling, step N+1 is scheduled, laid out and launched before step N is
accepted; each window's start and anchor are completed on the device from N's acceptance
(`DeferredInputs`). Greedy output must be what the engine gives when every step waits."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import (
    RandomLengthGate,
    emulated_graphs_config,
    gpu_graphs_config,
    tiny_engine_config,
    use_emulated_graphs,
)

from dspark import LLMEngine, SamplingParams
from dspark.spec.gate import SpeculationGate

PAGE = 4


def _count_launched_ahead(engine: LLMEngine) -> list[int]:
    """Wrap the engine's launch: the returned list counts the steps launched before the one on the
    device was accepted."""
    count = [0]
    launch = engine._launch

    def counted(in_flight=None, earlier=None):  # noqa: ANN001, ANN202 - the engine's own signature
        launched = launch(in_flight, earlier)
        if in_flight is not None and launched is not None:
            count[0] += 1
        return launched

    engine._launch = counted  # type: ignore[method-assign]
    return count


def _run(engine: LLMEngine, prompts, params, abort_after: dict[str, int] | None = None) -> dict[str, tuple]:
    """Each request's (tokens, text, finish reason), the engine stepped until nothing is left;
    `abort_after`: request id -> the call after which it is aborted."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    texts = {key: "" for key in tokens}
    reasons: dict[str, str | None] = {key: None for key in tokens}
    calls = 0
    while engine.has_unfinished_requests():
        assert calls < 5000, "the engine stopped making progress"
        for delta in engine.step():
            assert reasons[delta.request_id] is None, "a delta after the request's end"
            assert delta.error is None, delta.error
            tokens[delta.request_id] += delta.new_token_ids
            texts[delta.request_id] += delta.new_text
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        calls += 1
        for request_id, after in (abort_after or {}).items():
            if calls == after:
                engine.abort_request(request_id)
    return {key: (tuple(tokens[key]), texts[key], reasons[key]) for key in tokens}


def _greedy_requests(rng: random.Random, count: int, vocab: int = 8) -> tuple[list[list[int]], list]:
    """Prompts of every length (some longer than a step's token budget: chunked prefill) and greedy
    requests that end by length or at EOS, some early; the first one runs 40 tokens, so that every
    draw has steps to launch ahead."""
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(count)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=rng.random() < 0.5) for _ in range(count)
    ]
    params[0] = SamplingParams(max_tokens=40, ignore_eos=True)
    return prompts, params


@pytest.mark.parametrize("spec_mode", ["off", "static"])
def test_steps_launched_ahead_give_the_tokens_of_steps_that_wait(
    tiny_target_dir, tiny_drafter_dir, spec_mode
) -> None:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 12)
    config = tiny_engine_config(
        tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode, num_kv_pages=96, max_num_batched_tokens=24
    )
    waiting = _run(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config)
    ahead = _count_launched_ahead(engine)
    assert _run(engine, prompts, params) == waiting
    assert engine.allocator.num_used == 0
    if spec_mode == "off":  # eager `static` drafts apart, from the host: those steps wait
        assert ahead[0] > 10, ahead
    # Without launch_ahead, no step goes ahead, and the output is the same.
    engine = LLMEngine(config.replace(launch_ahead=False))
    none_ahead = _count_launched_ahead(engine)
    assert _run(engine, prompts, params) == waiting
    assert none_ahead[0] == 0


def _emulated_graphs_engine(target_dir, drafter_dir, **changes) -> LLMEngine:
    """An engine whose target steps replay emulated graphs (32 tokens, 4 requests), and whose `static`
    drafts are made inside the target step, from its layout: the path of a GPU, on the CPU."""
    return use_emulated_graphs(LLMEngine(emulated_graphs_config(target_dir, drafter_dir, **changes)))


# `compact` under the flat SPS table (the default) drafts inside the step as `static` does.
@pytest.mark.parametrize("spec_mode", ["off", "static", "compact"])
def test_graph_steps_launched_ahead_complete_their_windows_on_the_device(
    tiny_target_dir, tiny_drafter_dir, spec_mode
) -> None:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 9)
    waiting_engine = _emulated_graphs_engine(
        tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode, overlap_scheduling=False
    )
    waiting = _run(waiting_engine, prompts, params)
    engine = _emulated_graphs_engine(tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode)
    ahead = _count_launched_ahead(engine)
    out = _run(engine, prompts, params)
    assert out == waiting
    assert engine.allocator.num_used == 0
    # `static` drafts inside the step from the completed layout: its anchors and starts must be right
    # for the drafts to be accepted about as often as when steps wait (wrong ones would still be
    # lossless). The tiny drafter's drafts are seldom accepted, and some draws accept none either way.
    assert ahead[0] > 10, ahead
    accepted = engine.total_spec_stats.accepted_tokens
    assert accepted >= waiting_engine.total_spec_stats.accepted_tokens // 2, accepted


def test_a_request_with_sampling_makes_steps_wait_until_it_ends(tiny_target_dir) -> None:
    rng = random.Random(7)
    prompts, params = _greedy_requests(rng, 5)
    params[2] = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    config = tiny_engine_config(tiny_target_dir, spec_mode="off")
    waiting = _run(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config)
    _count_launched_ahead(engine)
    assert _run(engine, prompts, params) == waiting


def test_an_abort_of_a_request_launched_ahead_ends_it_alone(tiny_target_dir) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3
    config = tiny_engine_config(tiny_target_dir, spec_mode="off")
    full = _run(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config)
    ahead = _count_launched_ahead(engine)
    out = _run(engine, prompts, params, abort_after={"r1": 6})
    assert ahead[0] > 0
    tokens, _, reason = out["r1"]
    assert reason == "abort"
    assert 0 < len(tokens) < 30 and tokens == full["r1"][0][: len(tokens)]
    assert out["r0"] == full["r0"] and out["r2"] == full["r2"]
    assert engine.allocator.num_used == 0


def test_the_gate_times_overlapping_steps_by_the_wall_time_each_adds() -> None:
    now = [0.0]
    gate = SpeculationGate(3, lambda: now[0])
    # Steps of length 3 prepared at 0, 1 and 3 ms; each launched before the one before it finishes
    # (at 2, 5 and 6 ms). Step 2 added 3 ms (from step 1's finish), not the 4 ms since its preparation
    # began; steps 1 and 3 are not measured: the first has a step launched behind it before it
    # finished (both preparations are in its time), the last a plain step (its preparation would be
    # charged to length 3).
    gate.start_step(3, 0.0)
    now[0] = 0.001
    gate.start_step(3)
    now[0] = 0.002
    gate.finish_step([2, 2, 2, 2])
    now[0] = 0.003
    gate.start_step(3)
    now[0] = 0.005
    gate.finish_step([2, 2, 2, 2])
    gate.start_step(0)
    now[0] = 0.006
    gate.finish_step([2, 2, 2, 2])
    # The 3 ms step 2 added, for the tokens the gate expects of 4 requests at length 3 (two a request, one
    # draft accepted and the second rejected, up to the acceptance's prior: the third never reached).
    tokens = 4 * gate._acceptance.tokens_per_request(3)
    assert tokens == pytest.approx(8, rel=0.05)
    assert gate.rates(4) == pytest.approx({3: tokens / 0.003})


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec_mode", ["off", "static", "compact"])
def test_steps_launched_ahead_on_the_gpu_through_cuda_graphs(
    tiny_target_dir, tiny_drafter_dir, spec_mode
) -> None:
    """The real GPU path: captured target graphs (`static` drafting inside them), the acceptance's copy
    to pinned memory behind an event, the deferred starts and anchors written into the graphs' static
    inputs. fp32 on a tiny model with clear greedy choices: the tokens of steps that wait."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 12)
    config = gpu_graphs_config(tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode)
    waiting = _run(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config)
    assert engine.runner.graphs is not None and engine.runner.graphs.captured
    ahead = _count_launched_ahead(engine)
    assert _run(engine, prompts, params) == waiting
    assert ahead[0] > 10, ahead
    assert engine.allocator.num_used == 0
    engine.close()


def test_graph_steps_launched_ahead_switching_draft_lengths_give_the_tokens_of_plain_steps(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    """The gate's choices change the verify window from one step to the next, including a plain step
    launched ahead of a drafting one and back: the tokens stay those of plain decoding with steps that
    wait."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 9)
    plain = _run(
        _emulated_graphs_engine(tiny_target_dir, None, spec_mode="off", overlap_scheduling=False),
        prompts,
        params,
    )
    engine = _emulated_graphs_engine(tiny_target_dir, tiny_drafter_dir, spec_mode="static")
    engine.gate = RandomLengthGate(engine.limits.block_size, random.Random(seed + 1))
    ahead = _count_launched_ahead(engine)
    assert _run(engine, prompts, params) == plain
    assert engine.allocator.num_used == 0
    assert ahead[0] > 10, ahead
    assert 0 < engine.total_spec_stats.drafting_steps < engine.total_spec_stats.steps
