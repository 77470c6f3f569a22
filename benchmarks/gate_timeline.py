"""Where the serve default's gate gets its step times: each step of one generate(), per draft length.

    python benchmarks/gate_timeline.py --device cuda --batch 64 --max-tokens 256 --out /tmp/timeline.json

Session 42 (H100, 64 requests): the serve default's gate timed plain steps at 1.8-2.3 ms, where the
plain engine's steps took 1.05-1.3 ms and the default's engine held at plain steps (`profile_host.py`'s
`gated-plain`) ran as fast as the plain engine; the gate chose drafting, and the default ran 0.61-0.70x
plain decoding. This records, for the serve default and then for the plain engine on the same batch,
every step: its draft length, whether it carried a prefill chunk, was launched ahead and replayed a
graph; the device's time for its target work (CUDA events around the runner's step, from the device
reaching its launch, so the device idling while the host fills the step counts; none on a CPU) and the
device's idle time before it; the host's time launching it and completing it (the wait for the device
included); its finish-to-finish time (between the moments the engine tells its gate, gate or not, that
the step before and the step are done: `LLMEngine._tell_gate`); and the time the gate recorded for it,
if any. It prints per engine and length: steps, steps the gate timed, and medians of the gate's times,
of those steps' device and finish-to-finish times and of every decode-only step's. A gate time far above
its steps' finish-to-finish times is the gate's measurement; finish-to-finish far above the device time,
with the device idle between steps, is the host.

`--before 256,128 --before-runs 4`: each engine, sized for the largest batch, first runs 4 generate()s
of `--max-tokens` at each of those batch sizes, as `ab_trees.py --batch-sizes 256,128,64` does before
its batch of 64: does what the gate learnt at other batch sizes move its choice at this one? (Session
42's `ab_trees.py` saw the serve default at 0.61x plain at 64 requests; one engine at a time, session
43, 1.21x.)

With --syncs (a GPU; the timed runs then go again with it): per step, the host's synchronising calls
(torch's sync debug mode: `.item()`, `.tolist()`, copies to pageable memory), the caching allocator's
device allocations and frees (each a cudaMalloc / cudaFree, which wait for the device) and the pinned
host allocator's (cudaHostAlloc / cudaFreeHost, behind every step's queued host-to-device copy): a
step that waits for the device before launching the next loses the overlap, and runs host + device in
series.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from e2e import _prompt_ids, _time_sustained_once, add_engine_arguments, answer_lengths, bench_config

from dspark import LLM, SamplingParams
from dspark.spec import gate as gate_module


@dataclass
class StepRecord:
    """One engine step as the timeline saw it."""

    length: int
    prefill: bool
    ahead: bool = False  # launched before the step before it was accepted (overlap)
    replayed: bool = False  # its target work replayed a captured graph
    finish_s: float = 0.0
    launch_ms: float = 0.0  # the host's time in `_launch` (schedule, drafts, plan, layout, the run call)
    complete_ms: float = 0.0  # the host's time in `_complete` (the wait for the device included)
    device_ms: float | None = None  # from the device reaching its launch to the end of its target work
    device_idle_ms: float | None = None  # the device idle before it: the previous step's end to its launch
    gate_ms: float | None = None  # the time the gate recorded for it, if it recorded one
    syncs: list[str] = field(default_factory=list)  # --syncs: the synchronising calls up to its completion
    device_allocs: int = 0  # --syncs: cudaMalloc / cudaFree calls up to its completion
    host_allocs: int = 0  # --syncs: pinned host blocks created or returned (cudaHostAlloc / cudaFreeHost)


class Timeline:
    """Hooks on one engine that record its steps (`StepRecord`) while `recording` is set."""

    def __init__(self, llm: LLM, syncs: bool = False) -> None:
        self.engine = llm.engine
        self.syncs = syncs
        self.caught: list[warnings.WarningMessage] = []  # the sync debug mode's warnings (--syncs)
        self._seen = 0
        self._allocs = (0, 0)
        self.records: list[StepRecord] = []
        self.recording = False
        self._events: list[tuple[StepRecord, object, object]] = []
        self._open: list[StepRecord] = []  # launched, not yet completed, oldest first
        self._completed: StepRecord | None = None  # the step the engine's call completed last
        self._prefill = False  # whether the step being launched carries a prefill chunk
        self._ahead = False  # whether the step being launched goes ahead of one not yet accepted
        self._gate_value: list[float] = []
        self._hook()

    def _hook(self) -> None:
        engine, timeline = self.engine, self
        cuda = engine.limits.device.type == "cuda"
        gate = engine.gate
        if gate is not None:
            start_step, finish_burst = gate.start_step, gate.finish_burst

            def started(length, at=None, prefill=False):  # noqa: ANN001, ANN202 - the gate's signature
                # Told once the step is launched: its records (made as it ran) are the newest open ones.
                for record in reversed(timeline._open):
                    if record.length >= 0:
                        break
                    record.length = length
                return start_step(length, at, prefill)

            def finished(committed, verified=None):  # noqa: ANN001, ANN202
                # Told at the end of the engine's call that completed the step (its tokens emitted).
                timeline._gate_value.clear()
                result = finish_burst(committed, verified)
                record = timeline._completed
                if timeline.recording and record is not None and timeline._gate_value:
                    record.gate_ms = 1e3 * timeline._gate_value[-1]
                return result

            gate.start_step, gate.finish_burst = started, finished  # type: ignore[method-assign]
        schedule = engine.scheduler.schedule

        def scheduled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the scheduler's signature
            step = schedule(*args, **kwargs)
            timeline._prefill = step is not None and bool(step.prefill)
            return step

        engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
        launch = engine._launch

        def launched(in_flight=None, earlier=None):  # noqa: ANN001, ANN202 - the engine's signature
            timeline._ahead = in_flight is not None
            began = time.perf_counter()
            result = launch(in_flight, earlier)
            if result is not None and timeline.recording and timeline._open:
                timeline._open[-1].launch_ms = 1e3 * (time.perf_counter() - began)
            return result

        engine._launch = launched  # type: ignore[method-assign]
        run = engine.runner.run

        def run_step(step):  # noqa: ANN001, ANN202 - the runner's signature
            if not timeline.recording:
                return run(step)
            # A gated step's length is told to the gate once launched (`started`): -1 until then.
            record = StepRecord(-1 if gate is not None else 0, timeline._prefill, timeline._ahead)
            record.replayed = engine.runner.replays(step)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                result = run(step)
                end.record()
                timeline._events.append((record, begin, end))
            else:
                result = run(step)
            timeline._open.append(record)
            return result

        engine.runner.run = run_step  # type: ignore[method-assign]
        complete = engine._complete

        def completed(launched, queued=None):  # noqa: ANN001, ANN202 - the engine's signature
            began = time.perf_counter()
            done = complete(launched, queued)
            timeline._completed = None
            if timeline.recording and timeline._open:
                record = timeline._completed = timeline._open.pop(0)
                record.complete_ms = 1e3 * (time.perf_counter() - began)
                timeline.records.append(record)
                if timeline.syncs:
                    timeline._attribute(record)
            return done

        engine._complete = completed  # type: ignore[method-assign]
        tell_gate = engine._tell_gate

        def told():  # noqa: ANN202 - the engine's signature
            # A step finishes where the engine tells its gate (it does so with or without one): at the
            # end of the call that completed it, its tokens emitted, or before a launch behind it.
            tell_gate()
            if timeline._completed is not None:
                timeline._completed.finish_s = time.perf_counter()
                timeline._completed = None

        engine._tell_gate = told  # type: ignore[method-assign]

    def _attribute(self, record: StepRecord) -> None:
        """Give `record` the synchronising calls and device allocations since the last completion."""
        new = self.caught[self._seen :]
        self._seen = len(self.caught)
        record.syncs = [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in new]
        allocs = _allocation_counts()
        record.device_allocs = allocs[0] - self._allocs[0]
        record.host_allocs = allocs[1] - self._allocs[1]
        self._allocs = allocs

    def settle(self) -> None:
        """Read the device times once the device is done."""
        if self._events:
            torch.cuda.synchronize()
        previous_end = None
        for record, begin, end in self._events:
            record.device_ms = begin.elapsed_time(end)  # type: ignore[attr-defined]
            if previous_end is not None:
                record.device_idle_ms = max(previous_end.elapsed_time(begin), 0.0)
            previous_end = end
        self._events.clear()


def _allocation_counts() -> tuple[int, int]:
    """The CUDA caching allocator's device allocations + frees so far, and its pinned host allocator's
    (0 where this torch does not count them)."""
    stats = torch.cuda.memory_stats()
    device = stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)
    try:
        host_stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return device, 0
    return device, host_stats.get("num_host_alloc", 0) + host_stats.get("num_host_free", 0)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summary(records: list[StepRecord]) -> list[dict]:
    """Per draft length: the steps, those the gate timed, and the medians (ms) of the gate's times and of
    the device and finish-to-finish times of the timed steps and of every decode-only step."""
    rows = []
    gaps = [None] + [1e3 * (b.finish_s - a.finish_s) for a, b in zip(records, records[1:], strict=False)]
    for length in sorted({r.length for r in records}):
        mine = [(r, g) for r, g in zip(records, gaps, strict=True) if r.length == length]
        timed = [(r, g) for r, g in mine if r.gate_ms is not None]
        decode = [(r, g) for r, g in mine if not r.prefill]
        prefill = [(r, g) for r, g in mine if r.prefill]
        syncs = collections.Counter(where for r, _ in mine for where in r.syncs)
        rows.append(
            {
                "length": length,
                "steps": len(mine),
                "gate_timed": len(timed),
                "gate_ms": _median([r.gate_ms for r, _ in timed]),
                "timed_device_ms": _median([r.device_ms for r, _ in timed if r.device_ms is not None]),
                "timed_finish_gap_ms": _median([g for _, g in timed if g is not None]),
                "decode_device_ms": _median([r.device_ms for r, _ in decode if r.device_ms is not None]),
                "decode_finish_gap_ms": _median([g for _, g in decode if g is not None]),
                "decode_device_idle_ms": _median(
                    [r.device_idle_ms for r, _ in decode if r.device_idle_ms is not None]
                ),
                "decode_gap_sum_ms": round(sum(g for _, g in decode if g is not None), 1),
                "prefill_steps": len(prefill),
                "prefill_finish_gap_ms": _median([g for _, g in prefill if g is not None]),
                "prefill_gap_sum_ms": round(sum(g for _, g in prefill if g is not None), 1),
                "prefill_replayed_share": round(sum(r.replayed for r, _ in prefill) / len(prefill), 3)
                if prefill
                else None,
                "decode_launch_ms": _median([r.launch_ms for r, _ in decode]),
                "decode_complete_ms": _median([r.complete_ms for r, _ in decode]),
                "replayed_share": round(sum(r.replayed for r, _ in mine) / len(mine), 3),
                "ahead_share": round(sum(r.ahead for r, _ in mine) / len(mine), 3),
                "steps_with_syncs": sum(1 for r, _ in mine if r.syncs),
                "syncs": dict(syncs.most_common(6)),
                "steps_with_device_allocs": sum(1 for r, _ in mine if r.device_allocs),
                "steps_with_host_allocs": sum(1 for r, _ in mine if r.host_allocs),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Time the serve default's and the plain engine's steps; print the tables, write every step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, max_tokens=256)
    parser.add_argument(
        "--syncs", action="store_true", help="also time with sync and allocation probes (GPU)"
    )
    parser.add_argument("--before", default="", help="comma-separated batch sizes run first")
    parser.add_argument("--before-runs", type=int, default=4, help="generate() calls at each --before size")
    parser.add_argument(
        "--sustained",
        type=int,
        default=0,
        help="instead of one batch: this many times --batch requests, --batch in flight (a finished "
        "request's slot refilled at once, as under a server's steady load)",
    )
    parser.add_argument(
        "--sustained-spread",
        type=float,
        default=0.0,
        help="--sustained's answer lengths drawn from --max-tokens * (1 -/+ this) (e2e.answer_lengths)",
    )
    parser.add_argument(
        "--modes",
        default="default,off",
        help="engines timed: default (the serve default's, gated), off, a spec_mode drafting every "
        "step at its full length (no gate), fixedL (the serve default's engine, its gate held at L "
        "drafts a step) or switchN (its gate alternating N plain launches and N at the block)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    before = [int(b) for b in args.before.split(",") if b]
    # The gate's recorded times: every value a step-time median takes in.
    added = gate_module._RecentMedian.add
    current: list[Timeline] = []

    def recording_add(self, value, provisional=False):  # noqa: ANN001, ANN202 - the median's signature
        if current:
            current[0]._gate_value.append(value)
        return added(self, value, provisional)

    gate_module._RecentMedian.add = recording_add  # type: ignore[method-assign]
    report: dict[str, object] = {"batch": args.batch, "max_tokens": args.max_tokens, "before": before}
    for name in args.modes.split(","):
        # fixedL / switchN: the serve default's engine, its gate's choices forced (what a length costs
        # there, and what switching between plain and drafting launches costs).
        forced = name.startswith(("fixed", "switch"))
        fields: dict[str, object] = {} if name == "default" or forced else {"spec_mode": name}
        if name not in ("default", "off") and not forced:
            fields["adaptive_speculation"] = False  # a fixed length: what the gate's mix is measured against
        draft_model = args.draft_model if name != "off" else ""
        config = bench_config(args.model, draft_model, args.device, max([args.batch, *before]), **fields)
        llm = LLM(config)
        if forced:
            _force_gate(llm, name)
        ids = _prompt_ids(llm, args.batch)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for size in before:
            earlier = _prompt_ids(llm, size)
            for _ in range(args.before_runs):
                llm.generate(params=params, prompt_token_ids=earlier)
        llm.generate(params=SamplingParams(max_tokens=32, ignore_eos=True), prompt_token_ids=ids)  # warm-up
        sustained = None
        if args.sustained:
            pool = _prompt_ids(llm, args.batch * args.sustained)
            sustained = (pool, answer_lengths(len(pool), args.max_tokens, args.sustained_spread))
        probes = [False, True] if args.syncs and llm.engine.limits.device.type == "cuda" else [False]
        for syncs in probes:
            timeline = Timeline(llm, syncs)
            current[:] = [timeline]
            key = f"{name}+syncs" if syncs else name
            report[key] = _timed(llm, timeline, ids, params, key, sustained)
            gate = llm.engine.gate
            if gate is not None:  # its estimated tokens/s per draft length at this batch, and where it timed
                report[key]["gate_rates"] = {n: round(rate) for n, rate in gate.rates(args.batch).items()}
                report[key]["gate_tiers"] = sorted(gate._tiers)
        llm.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report))


def _force_gate(llm: LLM, name: str) -> None:
    """Hold the engine's gate at `fixedL` drafts a step, or alternate `switchN` plain launches and N at
    the block size, whatever it measures."""
    gate, block = llm.engine.gate, llm.engine.limits.block_size
    assert gate is not None, "the serve default's engine has a gate"
    count = int(name.removeprefix("fixed").removeprefix("switch"))
    if name.startswith("fixed"):
        choices = itertools.repeat(min(count, block))
    else:
        choices = itertools.cycle([0] * count + [block] * count)
    gate.draft_length = lambda num_requests, draining=None: next(choices)  # type: ignore[method-assign]


def _timed(
    llm: LLM,
    timeline: Timeline,
    ids: list[list[int]],
    params: SamplingParams,
    name: str,
    sustained: tuple[list[list[int]], list[int]] | None = None,
) -> dict:
    """One recorded generate() (or, given `sustained`'s prompts and their answer lengths,
    `e2e._time_sustained_once` of them with len(ids) in flight): its tokens/s, the per-length summary
    (printed) and every step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if timeline.syncs:
            torch.cuda.synchronize()
            timeline.caught = caught
            timeline._attribute(StepRecord(0, False))  # the counts start here
            torch.cuda.set_sync_debug_mode("warn")
        timeline.recording = True
        start = time.perf_counter()
        try:
            if sustained is None:
                llm.generate(params=params, prompt_token_ids=ids)
            else:
                pool, lengths = sustained
                _time_sustained_once(llm, pool, len(ids), lengths)
        finally:
            elapsed = time.perf_counter() - start
            timeline.recording = False
            if timeline.syncs:
                torch.cuda.set_sync_debug_mode("default")
    timeline.settle()
    rows = summary(timeline.records)
    tokens = len(ids) * params.max_tokens if sustained is None else sum(sustained[1])
    device = sum(r.device_ms or 0.0 for r in timeline.records)
    idle = sum(r.device_idle_ms or 0.0 for r in timeline.records)
    # Between the steps' target work (acceptance kernels and copies run in the gaps, so an upper bound).
    idle_share = idle / (device + idle) if device + idle else None
    print(
        f"{name}: {tokens / elapsed:.0f} tok/s, {len(timeline.records)} steps, device idle between steps "
        f"{'n/a' if idle_share is None else f'{idle_share:.1%}'}"
    )
    for row in rows:
        print("  " + json.dumps(row))
    return {
        "tok_s": tokens / elapsed,
        "device_idle_share": idle_share,
        "lengths": rows,
        "steps": [asdict(r) for r in timeline.records],
    }


if __name__ == "__main__":
    main()
