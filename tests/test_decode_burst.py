"""Decode bursts (`decode_burst`): plain greedy steps launched back to back from one schedule, each
taking its anchors from the step before on the device (`dspark.engine.burst`). The output must be that
of the same steps one at a time, whatever ends a request inside a burst."""

from __future__ import annotations

import random

import pytest
from test_launch_ahead import _greedy_requests, _run
from tiny_models import emulated_graphs_config, tiny_engine_config, use_emulated_graphs

from dspark import LLMEngine, SamplingParams
from dspark.config import EngineConfig


def _count_bursts(engine: LLMEngine) -> list[int]:
    """Wrap the engine's burst launch: the list counts [bursts, steps in them]."""
    count = [0, 0]
    launch = engine._launch_burst

    def counted(schedule, length):  # noqa: ANN001, ANN202 - the engine's own signature
        count[0] += 1
        count[1] += length
        return launch(schedule, length)

    engine._launch_burst = counted  # type: ignore[method-assign]
    return count


def _engine(target_dir, graphs: bool, **changes) -> LLMEngine:
    """A plain-decoding engine, its steps eager or replayed from emulated graphs (the GPU path)."""
    if graphs:
        return use_emulated_graphs(
            LLMEngine(emulated_graphs_config(target_dir, None, spec_mode="off", **changes))
        )
    config = tiny_engine_config(target_dir, None, spec_mode="off", num_kv_pages=96, max_num_batched_tokens=24)
    return LLMEngine(config.replace(**changes))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "waiting"])
def test_bursts_give_the_tokens_of_steps_one_at_a_time(tiny_target_dir, graphs, overlap) -> None:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    # Requests that end by length and at EOS inside bursts, prompts chunked, more requests than fit.
    prompts, params = _greedy_requests(rng, 9)
    single = _run(_engine(tiny_target_dir, graphs, overlap_scheduling=False), prompts, params)
    burst = rng.choice([2, 3, 4, 7])
    engine = _engine(tiny_target_dir, graphs, overlap_scheduling=overlap, decode_burst=burst)
    bursts = _count_bursts(engine)
    assert _run(engine, prompts, params) == single, f"decode_burst={burst}"
    assert engine.allocator.num_used == 0
    assert bursts[0] > 0 and bursts[1] > bursts[0], bursts
    # Every step of a burst counts as a step; a burst is one call of the loop.
    assert engine.loop_counters.steps >= bursts[1]


def test_a_burst_streams_its_tokens_in_one_delta_and_stops_at_max_tokens(tiny_target_dir) -> None:
    engine = _engine(tiny_target_dir, True, decode_burst=4)
    bursts = _count_bursts(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=11, ignore_eos=True))
    sizes = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            sizes.append(len(delta.new_token_ids))
    # The prompt's step gives the first token; then bursts of 4, 4 and the 2 left (a burst never runs
    # past max_tokens).
    assert sizes == [1, 4, 4, 2], sizes
    assert bursts == [3, 10], bursts


def test_no_burst_while_a_request_samples_or_a_prompt_waits(tiny_target_dir) -> None:
    engine = _engine(tiny_target_dir, True, decode_burst=4)
    bursts = _count_bursts(engine)
    engine.add_request("greedy", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request(
        "sampled", [4, 5], SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert bursts == [0, 0]
    engine.add_request("waiting", [1], SamplingParams(max_tokens=4))
    assert not engine._bursts(), "a prompt waits: the next step takes it in"


def test_decode_burst_must_be_positive() -> None:
    with pytest.raises(ValueError, match="decode_burst"):
        EngineConfig(decode_burst=0)
