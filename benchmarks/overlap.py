"""Overlap scheduling on and off, side by side: tokens/s per mode and batch size, and on CUDA the share
of wall time the GPU is busy during steady decode (issue 20's goals).

Each mode (off, static, compact; drafting on every step) runs as one engine per setting: `ahead`
(`launch_ahead`: step N+1 is launched before step N is accepted, the default), `emit`
(`overlap_scheduling` alone: step N's text and deltas are made while N+1 runs), `off` (every step
waits) and `burst` (decode bursts of `--burst` steps, `decode_burst`; since session 44 a burst replayed
from graphs goes behind the step or burst on the device, eager ones wait for it);
their timed runs are interleaved (e2e.py's `_time_engines`), so a slow spell of the machine
falls on all. Greedy tokens must be identical in every setting; the script stops if they are not, in
fp32. `--shape qwen3-8b` runs plain decoding of a random-weight model of the Qwen3-8B shape instead.

GPU busy, two ways: after the batch's prompts are in and a few decode steps ran, `--busy-steps` engine
steps run under `torch.profiler`; busy (kernels) = the union of the GPU kernels' and copies' intervals /
the window's wall time (the profiler's own cost falls on both engines alike; the gaps between a
replayed graph's kernels count as idle). Then as many steps again without the profiler, CUDA events
around each step's target work: busy (stream) = their summed spans / the span from the first to the
last (the device idle between steps, waiting for the host, counts; gaps inside a step do not).

    .venv/bin/python benchmarks/overlap.py --device cuda --batch-sizes 1,8,64,128 --repeats 3
    .venv/bin/python benchmarks/overlap.py --device cuda --shape qwen3-8b --batch-sizes 1,8,64
    .venv/bin/python benchmarks/overlap.py --device cpu --batch-sizes 1,4 --max-tokens 32 --modes off
    .venv/bin/python benchmarks/overlap.py --device cuda --modes off,static --settings burst,ahead
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import _prompt_ids, _time_engines, bench_config, identical_share  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402


def _steady_window(llm: LLM, ids: list[list[int]], steps: int, max_tokens: int, window) -> object:  # noqa: ANN001
    """`window()`'s value, called with the batch's prompts admitted and decoded a few steps, around
    `steps` engine steps it runs itself; the requests are then run to their end."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"busy-{i}", prompt, params)
    for _ in range(8):  # prompts in (chunked prefill), decode under way
        engine.step()
    try:
        return window(lambda: [engine.step() for _ in range(steps)])
    finally:
        while engine.has_unfinished_requests():
            engine.step()


def busy_share(llm: LLM, ids: list[list[int]], steps: int, max_tokens: int) -> float | None:
    """The share of `steps` steady decode steps' wall time during which the GPU ran work: the union of
    its kernels' and copies' intervals under torch.profiler (None off CUDA). Gaps between the kernels
    of a replayed graph count as idle: with SmolLM2's few-microsecond kernels, a large share."""
    if llm.engine.limits.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    def window(run) -> tuple:  # noqa: ANN001
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            return prof, (time.perf_counter() - start) * 1e6

    prof, wall_us = _steady_window(llm, ids, steps, max_tokens, window)
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not intervals:
        return 0.0
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for s, e in intervals[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    # Kernel timestamps span the window plus the profiler's start-up; clip to the measured wall.
    return min(busy / wall_us, 1.0)


def stream_busy_share(llm: LLM, ids: list[list[int]], steps: int, max_tokens: int) -> float | None:
    """The share of `steps` steady decode steps during which the GPU's stream held the steps' target
    work: CUDA events around each runner call (a burst's later steps too), their summed spans over the
    span from the first to the last (None off CUDA). What the host makes the device wait for between
    steps counts as idle; gaps inside a step's work (between a graph's kernels) do not; the
    acceptance's small kernels and copies between steps count as idle. No profiler: the host runs at
    its own pace."""
    if llm.engine.limits.device.type != "cuda":
        return None
    runner = llm.engine.runner
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timing(call):  # noqa: ANN001, ANN202 - a runner method: `run`, or `run_following` (a burst's later steps)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = call(*args, **kwargs)
            end.record()
            spans.append((begin, end))
            return result

        return timed

    def window(run) -> None:  # noqa: ANN001
        names = ("run", "run_following")
        own = {name: vars(runner).get(name) for name in names}  # wrappers set before, else the class's
        for name in names:
            setattr(runner, name, timing(getattr(runner, name)))
        try:
            run()
        finally:
            for name in names:
                if own[name] is None:
                    delattr(runner, name)
                else:
                    setattr(runner, name, own[name])
        torch.cuda.synchronize()

    _steady_window(llm, ids, steps, max_tokens, window)
    if not spans:
        return 0.0
    busy = sum(begin.elapsed_time(end) for begin, end in spans)
    return min(busy / spans[0][0].elapsed_time(spans[-1][1]), 1.0)


SETTINGS = {
    # name: (overlap_scheduling, launch_ahead, decode bursts of --burst steps)
    "ahead": (True, True, False),  # step N+1 launched before step N is accepted (the default)
    "emit": (True, False, False),  # step N's text and deltas made while step N+1 runs
    "off": (False, False, False),  # every step waits for its device work
    "burst": (True, True, True),  # decode bursts of --burst steps (`decode_burst`)
}


def qwen3_8b_checkpoint(work: Path) -> str:
    """A random-weight Qwen3-8B-shaped bf16 checkpoint (tp_gpu.py's recipe) with a placeholder
    tokenizer, written once under `work`: the issue's large-model shape, plain decoding only."""
    import tp_gpu
    from gpu_e2e import write_placeholder_tokenizer

    checkpoint = tp_gpu.write_checkpoint(work / "qwen3-8b-random", tp_gpu.QWEN3_8B, "bfloat16")
    write_placeholder_tokenizer(checkpoint, tp_gpu.QWEN3_8B["vocab_size"])
    return str(checkpoint)


def main(argv: list[str] | None = None) -> None:
    """Run the sweep, print a markdown table, write JSON with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument(
        "--shape", choices=["", "qwen3-8b"], default="", help="a random-weight model of this shape"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/dspark-overlap"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,64,128")
    parser.add_argument("--modes", default="off,static,compact")
    parser.add_argument("--settings", default="ahead,emit,off", help=f"of {','.join(SETTINGS)}")
    parser.add_argument("--burst", type=int, default=4, help="decode_burst of the `burst` setting")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median counts)")
    parser.add_argument("--busy-steps", type=int, default=50, help="steps in the GPU-busy window (0: skip)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    settings = args.settings.split(",")
    model = args.model
    if args.shape == "qwen3-8b":
        model, modes = qwen3_8b_checkpoint(args.work), ["off"]  # random weights: no drafter accepts
    base = bench_config(model, args.draft_model, args.device, max(batch_sizes))
    engines = {}
    for mode in modes:
        for setting in settings:
            overlap, ahead, burst = SETTINGS[setting]
            config = base.replace(
                spec_mode=mode,
                adaptive_speculation=False,
                overlap_scheduling=overlap,
                launch_ahead=ahead,
                decode_burst=args.burst if burst else 1,
            )
            engines[f"{mode}/{setting}"] = LLM(config)
    any_engine = next(iter(engines.values())).engine
    dtype, device = any_engine.limits.dtype, any_engine.limits.device
    baseline = "off" if "off" in settings else settings[-1]
    rows = []
    for batch in batch_sizes:
        ids = _prompt_ids(next(iter(engines.values())), batch)
        timed = _time_engines(engines, ids, args.max_tokens, None, args.repeats)
        row: dict = {"batch": batch}
        for mode in modes:
            base_run = timed[f"{mode}/{baseline}"]
            row[mode] = {}
            for setting in settings:
                run = timed[f"{mode}/{setting}"]
                same = identical_share(base_run[1], run[1])
                if same < 1.0 and dtype == torch.float32:
                    raise SystemExit(f"{mode}: overlap ({setting}) changed greedy output at batch {batch}")
                row[mode][setting] = {
                    "tok_s": run[0],
                    "ratio": run[0] / base_run[0],
                    "identical": same,
                    "tau": run[2]["mean_committed_per_step"],
                }
                if args.busy_steps:
                    llm = engines[f"{mode}/{setting}"]
                    row[mode][setting]["busy"] = busy_share(llm, ids, args.busy_steps, args.max_tokens)
                    row[mode][setting]["stream_busy"] = stream_busy_share(
                        llm, ids, args.busy_steps, args.max_tokens
                    )
        rows.append(row)
        print(json.dumps(row), flush=True)
    cells = " | ".join(
        f"{s} tok/s | {s} / {baseline} | GPU busy {s} (kernels) | GPU busy {s} (stream)" for s in settings
    )
    lines = [f"| batch | mode | {cells} | identical |", "|---:|---|" + "---:|" * (4 * len(settings) + 1)]
    for row in rows:
        for mode in modes:
            r = row[mode]
            parts = []
            for s in settings:
                busy, stream = (
                    "n/a" if r[s].get(k) is None else f"{r[s][k]:.0%}" for k in ("busy", "stream_busy")
                )
                parts.append(f"{r[s]['tok_s']:.1f} | {r[s]['ratio']:.2f} | {busy} | {stream}")
            same = min(r[s]["identical"] for s in settings)
            lines.append(f"| {row['batch']} | {mode} | {' | '.join(parts)} | {same:.0%} |")
    print("\n".join(lines))
    if args.out:
        meta = {
            "date": date.today().isoformat(),
            "machine": platform.node(),
            "device": str(device),
            "dtype": str(dtype),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
