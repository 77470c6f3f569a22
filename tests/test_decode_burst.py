"""Decode bursts (`decode_burst`): greedy steps launched back to back from one schedule, each taking
what the step before decided (anchors, accepted drafts) on the device (`dspark.engine.burst`), plain or
speculative with drafts made inside the step. The output must be that of the same steps one at a time,
whatever ends a request inside a burst."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_launch_ahead import _greedy_requests, _run
from tiny_models import (
    RandomLengthGate,
    emulated_graphs_config,
    gpu_graphs_config,
    tiny_engine_config,
    use_emulated_graphs,
)

from dspark import LLMEngine, SamplingParams
from dspark.config import GPU_DECODE_BURST, EngineConfig


def _count_bursts(engine: LLMEngine) -> list[int]:
    """Wrap the engine's burst launch: the list counts [bursts, steps in them, bursts launched behind a
    step or burst still in flight]."""
    count = [0, 0, 0]
    launch = engine._launch_burst

    def counted(schedule, plan, first, length, ahead=False):  # noqa: ANN001, ANN202 - the engine's own
        count[0] += 1
        count[1] += length
        count[2] += ahead
        return launch(schedule, plan, first, length, ahead)

    engine._launch_burst = counted  # type: ignore[method-assign]
    return count


def _engine(target_dir, graphs: bool, drafter_dir=None, **changes) -> LLMEngine:
    """An engine (plain decoding without `drafter_dir`), its steps eager or replayed from emulated
    graphs (the GPU path: a `static` step's drafts made inside it)."""
    changes.setdefault("spec_mode", "off" if drafter_dir is None else "static")
    if graphs:
        config = emulated_graphs_config(target_dir, drafter_dir, **changes)
        return use_emulated_graphs(LLMEngine(config))
    # On the CPU: on a GPU machine `auto` would replay real CUDA graphs (and draft inside the step).
    config = tiny_engine_config(
        target_dir, drafter_dir, num_kv_pages=96, max_num_batched_tokens=24, device="cpu"
    )
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
    # Replayed from graphs with overlap, bursts go ahead of the step or burst on the device (completed
    # from its outputs there); eager ones wait for it (their later steps are packed from the schedule).
    assert (bursts[2] > 0) == (graphs and overlap), bursts
    # Every step of a burst counts as a step, and as a burst's; a burst is one call of the loop.
    assert engine.loop_counters.steps >= bursts[1]
    assert engine.loop_counters.burst_steps == bursts[1]
    assert engine.loop_counters.bursts == bursts[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "waiting"])
def test_a_burst_runs_past_the_ends_of_a_few_requests(tiny_target_dir, graphs, overlap) -> None:
    """Requests whose max_tokens fall at different steps: a burst is not cut at the fewest tokens any
    request has left (each ending would cut the whole batch's bursts short), only where the rows it
    computes for requests already ended would reach a quarter of its rows; the ended ones keep their
    tokens up to their end, as one step at a time."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    count = 12
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 6))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randrange(6, 40), ignore_eos=True) for _ in prompts]
    changes = {"max_num_seqs": count, "max_num_batched_tokens": 64}
    single = _run(_engine(tiny_target_dir, graphs, overlap_scheduling=False, **changes), prompts, params)
    engine = _engine(tiny_target_dir, graphs, overlap_scheduling=overlap, decode_burst=4, **changes)
    lengths = []
    launch = engine._launch_burst

    def counted(schedule, plan, first, length, ahead=False):  # noqa: ANN001, ANN202 - the engine's own
        # The rows for requests ended inside it, as the host knows them when nothing is in flight.
        ended = sum(max(0, length - seq.remaining_tokens) for seq in schedule.decode)
        lengths.append((length, ended, len(schedule.decode), ahead))
        return launch(schedule, plan, first, length, ahead)

    engine._launch_burst = counted  # type: ignore[method-assign]
    assert _run(engine, prompts, params) == single
    assert engine.allocator.num_used == 0
    # Some burst ran past a request's end (with twelve lengths drawn from 34, nearly every draw has one),
    # and none computed a quarter of its rows or more for ended requests (of those the host knew of).
    assert any(ended for _, ended, _, _ in lengths), lengths
    assert all(ended < length * n / 4 for length, ended, n, ahead in lengths if not ahead), lengths


# `compact` under the flat SPS table (the default) drafts inside the step as `static` does.
@pytest.mark.parametrize("spec_mode", ["static", "compact"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "waiting"])
def test_speculative_bursts_give_the_tokens_of_steps_one_at_a_time(
    tiny_target_dir, tiny_drafter_dir, spec_mode, overlap
) -> None:
    # The gate times each step apart: bursts run without it.
    changes = {"spec_mode": spec_mode, "adaptive_speculation": False}
    for _ in range(3):  # the tiny drafter's drafts are seldom accepted: three draws
        seed = random.randrange(2**31)
        print(f"seed={seed}")
        rng = random.Random(seed)
        prompts, params = _greedy_requests(rng, 9)
        single_engine = _engine(tiny_target_dir, True, tiny_drafter_dir, overlap_scheduling=False, **changes)
        single = _run(single_engine, prompts, params)
        burst = rng.choice([3, 4, 6])  # 3+: a step after two others adds both steps' accepted drafts
        engine = _engine(
            tiny_target_dir, True, tiny_drafter_dir, overlap_scheduling=overlap, decode_burst=burst, **changes
        )
        bursts = _count_bursts(engine)
        assert _run(engine, prompts, params) == single, f"decode_burst={burst}"
        assert engine.allocator.num_used == 0
        assert bursts[0] > 0 and bursts[1] > bursts[0], bursts
        assert (bursts[2] > 0) == overlap, bursts
        # Every step of a burst verified its drafts: the speculation statistics count them as steps, and
        # drafts made from a layout completed right are accepted about as often as one step at a time.
        stats = engine.total_spec_stats
        assert stats.steps >= bursts[1]
        assert stats.accepted_tokens >= single_engine.total_spec_stats.accepted_tokens // 2, stats


def test_bursts_under_the_gate_give_the_tokens_of_steps_one_at_a_time(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    # The serve default: `static` with the gate choosing each step's draft length (0: plain) by the
    # speed it measured; a burst runs at the length chosen, timed as its steps' share of its wall time.
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 9)
    gate = {"adaptive_speculation": True}
    single = _run(
        _engine(tiny_target_dir, True, tiny_drafter_dir, overlap_scheduling=False, **gate), prompts, params
    )
    engine = _engine(tiny_target_dir, True, tiny_drafter_dir, decode_burst=4, **gate)
    bursts = _count_bursts(engine)
    assert _run(engine, prompts, params) == single
    assert engine.allocator.num_used == 0
    assert bursts[0] > 0, bursts
    # Measured at some batch size (behind bursts launched ahead, a draw's few steady steps at 4 requests
    # may all border a step of another kind, which the gate does not time).
    assert engine.gate is not None
    assert any(engine.gate.rates(n) for n in range(1, 5)), "the gate measured nothing"


def test_a_gate_drafting_apart_bursts_its_plain_steps_only(tiny_target_dir, tiny_drafter_dir) -> None:
    """A CPU's serve default: the drafter drafts apart from the target step (eager steps), the gate picks
    each step's length. The steps it leaves plain may burst; a step that drafts does not (its later
    steps would need drafts from the host's state of the requests, behind the burst)."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 9)
    single = _run(_engine(tiny_target_dir, False), prompts, params)  # plain, one step at a time
    engine = _engine(tiny_target_dir, False, tiny_drafter_dir, adaptive_speculation=True, decode_burst=4)
    gate = RandomLengthGate(engine.limits.block_size, rng)
    # Every other choice plain, the others random: with a random one alone, a draw whose ~20 decode-only
    # steps all drafted left nothing to burst (seed 143466820, ~1 draw in 400).
    choose, choices = gate.draft_length, itertools.count()
    gate.draft_length = lambda num_requests, draining=None: 0 if next(choices) % 2 else choose(num_requests)  # type: ignore[method-assign]
    engine.gate = gate
    plans = []
    launch = engine._launch_burst

    def counted(schedule, plan, first, length, ahead=False):  # noqa: ANN001, ANN202 - the engine's own
        plans.append(plan)
        return launch(schedule, plan, first, length, ahead)

    engine._launch_burst = counted  # type: ignore[method-assign]
    assert _run(engine, prompts, params) == single
    assert engine.allocator.num_used == 0
    assert plans, "no step the gate left plain burst"
    assert all(plan.drafts is None and not any(plan.verify_lens) for plan in plans)
    assert engine.total_spec_stats.drafted_tokens > 0, "the drafting steps ran too"


@pytest.mark.parametrize("spec_mode", ["off", "static"])
def test_an_abort_while_bursts_go_ahead_ends_that_request_alone(
    tiny_target_dir, tiny_drafter_dir, spec_mode
) -> None:
    # Bursts launched behind bursts in flight: an aborted request commits a prefix of its tokens and
    # nothing after its end; the others give their whole output, and every page comes back.
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 3
    drafter = None if spec_mode == "off" else tiny_drafter_dir
    changes = {"spec_mode": spec_mode, "adaptive_speculation": False}
    full = _run(_engine(tiny_target_dir, True, drafter, overlap_scheduling=False, **changes), prompts, params)
    for after in (2, 3, 4):
        engine = _engine(tiny_target_dir, True, drafter, decode_burst=4, **changes)
        bursts = _count_bursts(engine)
        out = _run(engine, prompts, params, abort_after={"r1": after})
        assert bursts[2] > 0, bursts
        tokens, _, reason = out["r1"]
        assert reason == "abort", after
        assert len(tokens) < 30 and tokens == full["r1"][0][: len(tokens)], after
        assert out["r0"] == full["r0"] and out["r2"] == full["r2"], after
        assert engine.allocator.num_used == 0


def test_plain_and_drafting_bursts_go_ahead_of_each_other_in_any_order(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    # A gate that picks a random draft length every step: plain bursts behind drafting ones (completed
    # from the drafts those accepted in all) and the reverse, single steps between them.
    ahead = 0
    for _ in range(4):  # a draw runs a burst ahead about once in 20 times or not at all: four draws
        seed = random.randrange(2**31)
        print(f"seed={seed}")
        rng = random.Random(seed)
        prompts, params = _greedy_requests(rng, 9)
        plain = _run(_engine(tiny_target_dir, True, overlap_scheduling=False), prompts, params)
        engine = _engine(tiny_target_dir, True, tiny_drafter_dir, decode_burst=rng.choice([2, 3, 4]))
        engine.gate = RandomLengthGate(engine.limits.block_size, random.Random(seed + 1))
        bursts = _count_bursts(engine)
        assert _run(engine, prompts, params) == plain
        assert engine.allocator.num_used == 0
        assert 0 < engine.total_spec_stats.drafting_steps < engine.total_spec_stats.steps
        ahead += bursts[2]
    assert ahead > 1, ahead


def test_no_speculative_burst_when_drafts_are_made_apart(tiny_target_dir, tiny_drafter_dir) -> None:
    # Eager `static` steps draft apart from the target step, from the host's state of the requests.
    engine = _engine(tiny_target_dir, False, tiny_drafter_dir, adaptive_speculation=False, decode_burst=4)
    bursts = _count_bursts(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert bursts == [0, 0, 0]


def test_a_burst_streams_its_tokens_in_one_delta_and_stops_at_max_tokens(tiny_target_dir) -> None:
    engine = _engine(tiny_target_dir, True, decode_burst=4)
    bursts = _count_bursts(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=11, ignore_eos=True))
    sizes = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            sizes.append(len(delta.new_token_ids))
    # The prompt's step gives the first token; then bursts of 4, 4 and the 2 left (a burst never runs
    # past max_tokens, nor does one launched behind another: it counts the tokens that one commits at
    # least). Each goes ahead of what is on the device: the first behind the prompt's step.
    assert sizes == [1, 4, 4, 2], sizes
    assert bursts == [3, 10, 3], bursts


def test_no_burst_while_a_request_samples_or_a_prompt_waits(tiny_target_dir) -> None:
    engine = _engine(tiny_target_dir, True, decode_burst=4)
    bursts = _count_bursts(engine)
    engine.add_request("greedy", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request(
        "sampled", [4, 5], SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert bursts == [0, 0, 0]
    engine.add_request("waiting", [1], SamplingParams(max_tokens=4))
    assert not engine._bursts(), "a prompt waits: the next step takes it in"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_bursts_alternate_with_steps_that_take_prompts_in_under_steady_arrivals(
    tiny_target_dir, graphs
) -> None:
    """A server's load: a prompt arrives before every call. Steps that take prompts in alternate with
    bursts, no prompt waits more than one burst for its first token, and the tokens are those of steps
    one at a time."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    count = 12
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(1, 10))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randrange(8, 30), ignore_eos=True) for _ in range(count)]
    burst = rng.choice([3, 4])
    # Seats for every request: a prompt waits for the engine's choice alone, never for room.
    seats = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "num_kv_pages": 256}

    def arrivals(engine: LLMEngine, bursts: list[int]) -> tuple[dict[str, list[int]], dict[str, int], int]:
        """Request i is added before call i: each one's tokens, the calls from its arrival to its first
        token, and the bursts launched while prompts were still arriving."""
        tokens: dict[str, list[int]] = {}
        waited: dict[str, int] = {}
        calls, bursts_meanwhile = 0, 0
        while calls < count or engine.has_unfinished_requests():
            assert calls < 2000, "the engine stopped making progress"
            if calls < count:
                engine.add_request(f"r{calls}", prompts[calls], params[calls])
                tokens[f"r{calls}"] = []
            for delta in engine.step():
                assert delta.error is None, delta.error
                if not tokens[delta.request_id] and delta.new_token_ids:
                    waited[delta.request_id] = calls - int(delta.request_id[1:])
                tokens[delta.request_id] += delta.new_token_ids
            calls += 1
            if calls == count:
                bursts_meanwhile = bursts[0]
        return tokens, waited, bursts_meanwhile

    def engine(**changes) -> LLMEngine:
        if graphs:
            config = emulated_graphs_config(tiny_target_dir, spec_mode="off", **seats, **changes)
            return use_emulated_graphs(LLMEngine(config), requests=16, tokens=64)
        config = tiny_engine_config(tiny_target_dir, None, device="cpu", **seats)
        return LLMEngine(config.replace(spec_mode="off", **changes))

    single, single_waited, _ = arrivals(engine(), [0])
    bursting = engine(decode_burst=burst)
    bursts = _count_bursts(bursting)
    tokens, waited, bursts_meanwhile = arrivals(bursting, bursts)
    assert tokens == single, f"decode_burst={burst}"
    assert bursting.allocator.num_used == 0
    # Without leaving prompts waiting no step would burst while they arrive.
    assert bursts_meanwhile >= 2, bursts_meanwhile
    for request_id, calls in waited.items():
        assert calls <= single_waited[request_id] + 1, (request_id, calls, single_waited[request_id])


@pytest.mark.shipped_overlap  # the engine's own view of the CPU (the suite makes it look like a GPU's)
def test_decode_burst_must_not_be_negative_and_0_is_off_on_a_cpu(tiny_target_dir) -> None:
    with pytest.raises(ValueError, match="decode_burst"):
        EngineConfig(decode_burst=-1)
    # 0 (the default): bursts on a GPU, none on a CPU (eager bursts launch nothing ahead there).
    assert EngineConfig().decode_burst == 0
    engine = LLMEngine(
        tiny_engine_config(tiny_target_dir, None, device="cpu", decode_burst=0, spec_mode="off")
    )
    assert engine.limits.decode_burst == 1
    if torch.cuda.is_available():
        config = gpu_graphs_config(tiny_target_dir, None, decode_burst=0, spec_mode="off")
        assert LLMEngine(config).limits.decode_burst == GPU_DECODE_BURST


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec_mode", ["off", "static", "compact"])
def test_bursts_on_the_gpu_through_cuda_graphs(tiny_target_dir, tiny_drafter_dir, spec_mode) -> None:
    """The real GPU path: captured target graphs (`static` and `compact` drafting inside them), the static
    layout moved on by the device between a burst's replays, one pinned copy of a plain burst's argmax,
    each speculative step's acceptance queued behind an event. fp32 on a tiny model: the tokens of steps
    one at a time."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts, params = _greedy_requests(rng, 12)
    config = gpu_graphs_config(tiny_target_dir, tiny_drafter_dir, spec_mode=spec_mode)
    single = _run(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config.replace(decode_burst=4))
    assert engine.runner.graphs is not None and engine.runner.graphs.captured
    bursts = _count_bursts(engine)
    assert _run(engine, prompts, params) == single
    assert bursts[0] > 0 and bursts[1] > bursts[0], bursts
    assert engine.allocator.num_used == 0
    engine.close()
