"""Does the engine loop's host work slow down beside busy neighbour processes, and beside which kind?

Issue 18: served on the H200, every host phase of an engine step took ~1.5x its offline time, with
tritonserver, the backend stubs and the load generator's processes beside the engine. Processes that
only spin (a working set in the core's own cache) did not slow a pinned Python loop there
(`host_contention.py`); this runs the offline engine itself, pinned to one core, while neighbours on the
other cores either spin or stream through a buffer larger than the last-level cache (evicting the
engine's lines from the cache they share, and taking memory bandwidth), rounds alternated:

    python benchmarks/host_neighbours.py --device cuda --batch-sizes 64,256 \\
        --neighbours none,spin:8,stream:2:64,stream:8:64 --rounds 4
    python benchmarks/host_neighbours.py --tiny --batch-sizes 64 --neighbours none,spin:1,stream:1:64

A neighbour is `none`, `spin:K` (K processes) or `stream:K:MB` (K processes, each adding to a float64
buffer of MB megabytes over and over), placed on the other CPUs in turn, or with `@sibling` on the
engine core's SMT siblings only, with `@apart` on the CPUs of other physical cores only (e.g.
`spin:1@sibling,spin:7@apart`: is it the hyperthread beside the loop, or the host's clock with more cores
busy, that slows it? Session 40 on the H200: spin:8 on CPUs 1-8 made a batch-64 step 1.23x).
Prints, per batch size and neighbour, the median output
tokens/s, ms a step and the host's ms a step in each phase, and each one's ratio to `none`.
`--tiny`: the tests' 2-layer random target on the CPU through emulated CUDA graphs (host work of a GPU
step plus a small CPU forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agreement import loop_shares

from dspark import LLM, EngineConfig, SamplingParams
from dspark.outputs import STEP_PHASES

SPIN = "x = 0\nwhile True:\n    x += 1\n"
STREAM = "import numpy as np\na = np.ones({words})\nwhile True:\n    a += 1.0\n"


def smt_siblings(cpu: int) -> set[int]:
    """The logical CPUs sharing `cpu`'s physical core (itself included; just it where unreadable)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    siblings: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        siblings.update(range(int(first), int(last or first) + 1))
    return siblings


def placement(spec: str, engine_cpu: int, cpus: list[int]) -> list[int]:
    """The CPUs a neighbour spec's processes take in turn: every CPU but the engine's, its SMT siblings
    (`@sibling`) or the CPUs of other physical cores (`@apart`)."""
    where = spec.partition("@")[2] or "any"
    siblings = smt_siblings(engine_cpu) & set(cpus)
    chosen = {
        "any": [c for c in cpus if c != engine_cpu],
        "sibling": [c for c in cpus if c in siblings and c != engine_cpu],
        "apart": [c for c in cpus if c not in siblings],
    }.get(where)
    if chosen is None:
        raise ValueError(f"--neighbours: unknown placement @{where} in {spec!r} (sibling, apart)")
    if not chosen:
        raise SystemExit(
            f"--neighbours {spec}: no such CPU here (engine on {engine_cpu}, siblings {siblings})"
        )
    return chosen


def neighbour_code(spec: str) -> tuple[int, str | None]:
    """(processes, Python source each runs) of a neighbour spec (its placement aside)."""
    kind, *rest = spec.partition("@")[0].split(":")
    if kind == "none":
        return 0, None
    if kind == "spin":
        return int(rest[0]), SPIN
    if kind == "stream":
        return int(rest[0]), STREAM.format(words=int(float(rest[1]) * (1 << 20)) // 8)
    raise ValueError(f"--neighbours: unknown kind {spec!r} (none, spin:K, stream:K:MB)")


def start_neighbours(spec: str, cpus: list[int]) -> list[subprocess.Popen]:
    """Start a spec's processes, one per CPU of `cpus` in turn."""
    count, code = neighbour_code(spec)
    if code is None:
        return []
    processes = []
    for i in range(count):
        process = subprocess.Popen([sys.executable, "-c", code])
        os.sched_setaffinity(process.pid, {cpus[i % len(cpus)]})
        processes.append(process)
    return processes


def stop(processes: list[subprocess.Popen]) -> None:
    """Kill the neighbours and reap them."""
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def engine(args: argparse.Namespace, mode: str, batch: int) -> tuple[LLM, list[list[int]]]:
    """The offline engine in `mode` for `batch` requests, and their prompts' token ids."""
    if args.tiny:
        from host_costs import _tiny_llm  # beside this script, on the path as `agreement` is

        llm = _tiny_llm(mode, batch)
        return llm, [[(7 * i + j) % 500 + 1 for j in range(24)] for i in range(batch)]
    from e2e import _prompt_ids, bench_config

    config: EngineConfig = bench_config(args.model, args.draft_model, args.device, batch, spec_mode=mode)
    llm = LLM(config)
    return llm, _prompt_ids(llm, batch)


def timed(llm: LLM, ids: list[list[int]], params: SamplingParams) -> dict:
    """One generate() of `ids`: output tokens/s and the loop's figures (`loop_shares`)."""
    if llm.engine.limits.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    before = llm.engine.load().loop
    started = time.perf_counter()
    outputs = llm.generate(params=params, prompt_token_ids=ids)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tokens_per_s": tokens / seconds} | loop_shares(before, llm.engine.load().loop, seconds, tokens)


def main(argv: list[str] | None = None) -> int:
    """Alternate the neighbours round by round around each batch size's timed generate()."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny target on the CPU")
    parser.add_argument("--mode", default="off", help="spec_mode of the engine")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--neighbours", default="none,spin:8,stream:2:64,stream:8:64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait after starting neighbours")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # the engine's loop on one core, the neighbours on the others
    siblings = sorted(smt_siblings(cpus[0]))
    print(f"engine loop on CPU {cpus[0]} (SMT siblings {siblings}) of {len(cpus)}", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    specs = args.neighbours.split(",")
    # A bad spec, or a placement with no CPU here, fails before any engine loads.
    places = {spec: placement(spec, cpus[0], cpus) if neighbour_code(spec)[0] else [] for spec in specs}
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        llm, ids = engine(args, args.mode, batch)
        timed(llm, ids, params)  # warm-up: graphs, kernels, the allocator
        runs: dict[str, list[dict]] = {spec: [] for spec in specs}
        for _ in range(args.rounds):
            for spec in specs:
                neighbours = start_neighbours(spec, places[spec])
                try:
                    time.sleep(args.settle_s if neighbours else 0.0)
                    runs[spec].append(timed(llm, ids, params))
                finally:
                    stop(neighbours)
        llm.close()
        base = None
        for spec in specs:
            keys = ["tokens_per_s", "step_ms"] + [f"host_{phase}_ms" for phase in STEP_PHASES]
            row = {"batch": batch, "neighbours": spec}
            for key in keys:
                values = [run[key] for run in runs[spec] if key in run]
                if values:
                    row[key] = round(statistics.median(values), 4)
            base = base or row
            row["ratio_step_ms"] = round(row["step_ms"] / base["step_ms"], 3)
            rows.append(row)
            phases = ", ".join(
                f"{phase} {row[key]:.3f} ({row[key] / max(base[key], 1e-9):.2f}x)"
                for phase in STEP_PHASES
                if row.get(key := f"host_{phase}_ms", 0) > 0.001
            )
            print(
                f"batch {batch:4d} {spec:16s} {row['tokens_per_s']:9.0f} tok/s, {row['step_ms']:.3f} ms a "
                f"step ({row['ratio_step_ms']:.2f}x); host ms a step: {phases}",
                flush=True,
            )
    if args.out is not None:
        run = vars(args) | {"out": str(args.out)}
        summary = {"cpus": len(cpus), "engine_cpu": cpus[0], "smt_siblings": siblings}
        args.out.write_text(json.dumps(summary | {"args": run, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
