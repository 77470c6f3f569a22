"""Is the served engine's slower step the engine process's own doing, or the server's? The served
engine's host phases run 1.5-2x their offline time on the H200 host (issue 18). This runs the same
engine three ways side by side, at each concurrency, with the load generator's closed loop (each of
`level` streams submits its next request when the last one ends; greedy, ignore_eos):

- offline: `dspark.LLM` in this process (`agreement.offline_run`, one batch of `level` prompts);
- in process: the same engine stepped from this process's thread, fed by the closed loop (the
  arrivals' cost alone);
- engine process: `EngineProcess` (the spawned engine process the adapter runs, its control and
  sender threads, the delta pipe, the adapter-side text) driven from this process, no tritonserver;
- (through tritonserver is serving_overhead.py's served side).

    python benchmarks/engine_process_check.py --levels 1,64 --mode static [--profile-level 64 --out-dir D]

`--sync-debug` counts, by Python line, the calls that made the host wait for the device in the
in-process loop at the largest level (`torch.cuda.set_sync_debug_mode`; CUDA only).
`--profile-level L` then runs a longer load at L on each side, untimed, while py-spy (when installed)
samples this process and its engine process: collapsed stacks and their summary
(`benchmarks/pyspy_top.py`) in `--out-dir` (offline-L.txt, engine-process-L.txt and *-top.txt).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from agreement import loop_shares, offline_run  # noqa: E402
from pyspy_top import summarize  # noqa: E402
from serving_overhead import MODES, engine_config, start_profile  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine.llm_engine import LLMEngine  # noqa: E402
from dspark.serving.engine_process import EngineProcess  # noqa: E402
from dspark_client.bench import PROMPTS  # noqa: E402


def closed_loop(engine: EngineProcess, level: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """`level` streams, `requests` in all, each stream's next submitted when its last ends: seconds and
    output tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    lock, done = threading.Lock(), threading.Event()
    state = {"submitted": 0, "finished": 0, "tokens": 0}

    def submit_next() -> None:
        with lock:
            if state["submitted"] >= requests:
                return
            index = state["submitted"]
            state["submitted"] += 1
        engine.submit(f"r{index}", params, on_delta, prompt=PROMPTS[index % len(PROMPTS)])

    def on_delta(delta) -> None:  # noqa: ANN001 - RequestDelta
        with lock:
            state["tokens"] += len(delta.new_token_ids)
            if delta.finished:
                state["finished"] += 1
                if state["finished"] == requests:
                    done.set()
        if delta.finished:
            submit_next()

    started = time.perf_counter()
    for _ in range(level):
        submit_next()
    done.wait()
    return time.perf_counter() - started, state["tokens"]


def in_process_loop(engine: LLMEngine, level: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """`closed_loop` on an engine stepped from this thread: the same arrivals, no engine process."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [engine.prepare_prompt(p, None, params) for p in PROMPTS]
    submitted = finished = tokens = 0
    started = time.perf_counter()
    while finished < requests:
        while submitted < requests and submitted - finished < level:
            engine.add_request(f"s{submitted}", prompts[submitted % len(prompts)], params)
            submitted += 1
        for delta in engine.step():
            tokens += len(delta.new_token_ids)
            finished += delta.finished
    return time.perf_counter() - started, tokens


def synchronizing_calls(run) -> collections.Counter:  # noqa: ANN001 - a callable
    """Where `run` made the host wait for the device (`torch.cuda.set_sync_debug_mode`): the count of
    each synchronizing call by the Python line that made it."""
    found: collections.Counter = collections.Counter()
    if not torch.cuda.is_available():
        run()
        return found
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        found[f"{warning.filename}:{warning.lineno}"] += 1
    return found


def profile(out: Path, seconds: float, load) -> None:  # noqa: ANN001 - one round of the load
    """py-spy samples of this process and its children (from 3 s in, `seconds` long) while rounds of
    `load` run back to back, and their summary beside them."""
    profiler = start_profile(os.getpid(), out, seconds)
    ends = time.monotonic() + seconds + 4
    while time.monotonic() < ends:
        load()
    if profiler is not None:
        profiler.wait(seconds + 30)
        if out.exists():
            out.with_name(out.stem + "-top.txt").write_text(summarize(out, 30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,64")
    parser.add_argument("--mode", default="static", choices=sorted(MODES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile-level", type=int, default=0, help="a level to sample with py-spy")
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="count where the in-process loop at the largest level makes the host wait for the device",
    )
    parser.add_argument("--profile-s", type=float, default=6.0)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/dspark-engine-process-check"))
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    config = engine_config(args.mode, max(levels + [args.profile_level]))
    results: dict = {"offline": {}, "in_process": {}, "engine_process": {}}
    loops: dict = {}
    rates, _ = offline_run(config, levels, args.max_tokens, loops)
    for level in levels:
        results["offline"][level] = {"tokens_per_s": rates[level], "loop": loops[level]}
        print(f"offline        {level:>4}: {rates[level]:.0f} tok/s, loop {loops[level]}", flush=True)
    # The same closed loop on an engine in this process: the arrivals' cost without the engine process.
    with LLM(config) as llm:
        in_process_loop(llm.engine, 8, 16, 16)  # warm-up
        for level in levels:
            before = llm.engine.load().loop
            requests = args.requests_per_stream * level
            seconds, tokens = in_process_loop(llm.engine, level, requests, args.max_tokens)
            loop = loop_shares(before, llm.engine.load().loop, seconds, tokens)
            results["in_process"][level] = {"tokens_per_s": round(tokens / seconds, 1), "loop": loop}
            print(f"in process     {level:>4}: {tokens / seconds:.0f} tok/s, loop {loop}", flush=True)
        if args.sync_debug:
            level = max(levels)
            syncs = synchronizing_calls(
                lambda: in_process_loop(llm.engine, level, 2 * level, args.max_tokens)
            )
            results["in_process_syncs"] = dict(syncs.most_common())
            print(
                f"synchronizing calls, in process at {level} streams: {dict(syncs.most_common(20))}",
                flush=True,
            )
    level = args.profile_level
    if level:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        with LLM(config) as llm:
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(level)]
            llm.generate(prompts, params)
            profile(
                args.out_dir / f"offline-{level}.txt",
                args.profile_s,
                lambda: llm.generate(prompts, params),
            )
    engine = EngineProcess(config)
    engine.start()
    try:
        closed_loop(engine, 8, 16, 16)  # warm-up
        for level in levels:
            time.sleep(0.3)  # the last batch's load snapshot arrived
            before = engine.load().loop
            seconds, tokens = closed_loop(engine, level, args.requests_per_stream * level, args.max_tokens)
            time.sleep(0.3)
            loop = loop_shares(before, engine.load().loop, seconds, tokens)
            results["engine_process"][level] = {"tokens_per_s": round(tokens / seconds, 1), "loop": loop}
            print(f"engine process {level:>4}: {tokens / seconds:.0f} tok/s, loop {loop}", flush=True)
        level = args.profile_level
        if level:
            profile(
                args.out_dir / f"engine-process-{level}.txt",
                args.profile_s,
                lambda: closed_loop(engine, level, 4 * level, args.max_tokens),
            )
    finally:
        engine.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
