"""Overlap scheduling on and off, side by side: tokens/s per mode and batch size, and on CUDA the share
of wall time the GPU is busy during steady decode (issue 20's goals).

Each mode (off, static, compact; drafting on every step) runs as two engines that differ only in
`overlap_scheduling`; their timed runs are interleaved (e2e.py's `_time_engines`), so a slow spell
of the machine falls on both. Greedy tokens must be identical with overlap on and off (the engine
runs the same steps either way); the script stops if they are not, in fp32.

GPU busy: after the batch's prompts are in and a few decode steps ran, `--busy-steps` engine steps
run under `torch.profiler`; busy = the union of the GPU kernels' and copies' intervals / the window's
wall time (the profiler's own cost falls on both engines alike).

    .venv/bin/python benchmarks/overlap.py --device cuda --batch-sizes 1,8,64,128 --repeats 3
    .venv/bin/python benchmarks/overlap.py --device cpu --batch-sizes 1,4 --max-tokens 32 --modes off
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


def busy_share(llm: LLM, ids: list[list[int]], steps: int, max_tokens: int) -> float | None:
    """The share of `steps` steady decode steps' wall time during which the GPU ran work (None off
    CUDA). The prompts are admitted and decoded a few steps before the window opens."""
    engine = llm.engine
    if engine.limits.device.type != "cuda":
        return None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"busy-{i}", prompt, params)
    for _ in range(8):  # prompts in (chunked prefill), decode under way
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    while engine.has_unfinished_requests():
        engine.step()
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


def main(argv: list[str] | None = None) -> None:
    """Run the sweep, print a markdown table, write JSON with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,64,128")
    parser.add_argument("--modes", default="off,static,compact")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median counts)")
    parser.add_argument("--busy-steps", type=int, default=50, help="steps in the GPU-busy window (0: skip)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    base = bench_config(args.model, args.draft_model, args.device, max(batch_sizes))
    engines = {
        f"{mode}/{'on' if overlap else 'off'}": LLM(
            base.replace(spec_mode=mode, adaptive_speculation=False, overlap_scheduling=overlap)
        )
        for mode in modes
        for overlap in (True, False)
    }
    any_engine = next(iter(engines.values())).engine
    dtype, device = any_engine.limits.dtype, any_engine.limits.device
    rows = []
    for batch in batch_sizes:
        ids = _prompt_ids(next(iter(engines.values())), batch)
        timed = _time_engines(engines, ids, args.max_tokens, None, args.repeats)
        row: dict = {"batch": batch}
        for mode in modes:
            on, off = timed[f"{mode}/on"], timed[f"{mode}/off"]
            same = identical_share(off[1], on[1])
            if same < 1.0 and dtype == torch.float32:
                raise SystemExit(f"{mode}: overlap changed greedy output at batch {batch}")
            row[mode] = {
                "on": on[0],
                "off": off[0],
                "ratio": on[0] / off[0],
                "identical": same,
                "tau": on[2]["mean_committed_per_step"],
            }
            if args.busy_steps:
                for side in ("on", "off"):
                    share = busy_share(engines[f"{mode}/{side}"], ids, args.busy_steps, args.max_tokens)
                    row[mode][f"busy_{side}"] = share
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = (
        "| batch | mode | overlap on tok/s | off tok/s | on / off | GPU busy on | GPU busy off | identical |"
    )
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        for mode in modes:
            r = row[mode]
            busy_on, busy_off = r.get("busy_on"), r.get("busy_off")
            lines.append(
                f"| {row['batch']} | {mode} | {r['on']:.1f} | {r['off']:.1f} | {r['ratio']:.2f} | "
                f"{'n/a' if busy_on is None else f'{busy_on:.0%}'} | "
                f"{'n/a' if busy_off is None else f'{busy_off:.0%}'} | {r['identical']:.0%} |"
            )
    print("\n".join(lines))
    if args.out:
        meta = {
            "date": date.today().isoformat(),
            "machine": platform.node(),
            "device": str(device),
            "dtype": str(dtype),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "args": vars(args),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
