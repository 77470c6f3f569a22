"""Is the served engine's slower step the engine process's own doing, or the server's? The served
engine's host phases run 1.5-2x their offline time on the H200 host (issue 18). This runs the same
engine three ways side by side, at each concurrency, with the load generator's closed loop (each of
`level` streams submits its next request when the last one ends; greedy, ignore_eos):

- offline: `dspark.LLM` in this process (generate() of a batch of `level` prompts, once a request a
  stream: the closed loop's work);
- in process: the same engine stepped from this process's thread, fed by the closed loop (the
  arrivals' cost, with this benchmark's own client work on the loop's thread);
- engine process: `EngineProcess` (the spawned engine process the adapter runs, its control and
  sender threads, the delta pipe, the adapter-side text) driven from this process, no tritonserver;
- (through tritonserver is serving_overhead.py's served side).

    python benchmarks/engine_process_check.py --levels 1,64 --mode static [--profile-level 64 --out-dir D]

Both engines live through the whole run, and each of `--rounds` rounds (default 3) measures the three
sides of each level back to back: the host's speed drifts within a call (up to 2x on the H200 host), so
the ratios are taken within a round and their medians reported (`ratios`).

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
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from agreement import bench_prompts, loop_shares, timed_generate  # noqa: E402
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


def offline_once(llm: LLM, level: int, max_tokens: int, repeats: int = 1) -> dict:
    """`repeats` timed generate() calls of `level` bench prompts (`agreement.timed_generate`; as many
    as the closed loop's requests a stream: the same work): tokens/s and the loop's shares."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rate, _, loop = timed_generate(llm, level, params, repeats)
    return {"tokens_per_s": rate, "loop": loop}


def in_process_once(llm: LLM, level: int, requests_per_stream: int, max_tokens: int) -> dict:
    """`in_process_loop` at `level`: tokens/s and the loop's shares."""
    before = llm.engine.load().loop
    seconds, tokens = in_process_loop(llm.engine, level, requests_per_stream * level, max_tokens)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "loop": loop_shares(before, llm.engine.load().loop, seconds, tokens),
    }


def engine_process_once(engine: EngineProcess, level: int, requests_per_stream: int, max_tokens: int) -> dict:
    """`closed_loop` on the engine process at `level`: tokens/s and the loop's shares (from the load
    snapshots that travel with its deltas)."""
    time.sleep(0.3)  # the last batch's load snapshot arrived
    before = engine.load().loop
    seconds, tokens = closed_loop(engine, level, requests_per_stream * level, max_tokens)
    time.sleep(0.3)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "loop": loop_shares(before, engine.load().loop, seconds, tokens),
    }


def ratios(rounds: dict, levels: list[int]) -> dict:
    """Per level, the median over rounds of each side's tokens/s and of the ratios measured within a
    round: the engine process to the in-process loop, and each of them to offline."""
    out = {}
    for level in levels:
        rates = {side: [f["tokens_per_s"] for f in rounds[side][level]] for side in rounds}
        per_round = list(zip(rates["offline"], rates["in_process"], rates["engine_process"], strict=True))
        out[level] = {
            **{f"{side}_tokens_per_s": round(statistics.median(values), 1) for side, values in rates.items()},
            "engine_process_to_in_process": round(statistics.median(e / i for _, i, e in per_round), 3),
            "engine_process_to_offline": round(statistics.median(e / o for o, _, e in per_round), 3),
            "in_process_to_offline": round(statistics.median(i / o for o, i, _ in per_round), 3),
        }
    return out


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
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the three sides; medians are reported"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/dspark-engine-process-check"))
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    config = engine_config(args.mode, max(levels + [args.profile_level]))
    sides = ("offline", "in_process", "engine_process")
    rounds: dict = {side: {level: [] for level in levels} for side in sides}
    # Both engines live through every round: each round measures the three sides of a level back to
    # back, so a drift of the host's speed (up to 2x within one call on the H200 host) moves all three.
    with LLM(config) as llm:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        in_process_loop(llm.engine, 8, 16, 16)
        engine = EngineProcess(config)
        engine.start()
        try:
            closed_loop(engine, 8, 16, 16)  # warm-up
            for r in range(args.rounds):
                for level in levels:
                    measured = {
                        "offline": offline_once(llm, level, args.max_tokens, args.requests_per_stream),
                        "in_process": in_process_once(llm, level, args.requests_per_stream, args.max_tokens),
                        "engine_process": engine_process_once(
                            engine, level, args.requests_per_stream, args.max_tokens
                        ),
                    }
                    for side, figures in measured.items():
                        rounds[side][level].append(figures)
                        print(
                            f"round {r} {side:<14} {level:>4}: {figures['tokens_per_s']:.0f} tok/s, "
                            f"loop {figures['loop']}",
                            flush=True,
                        )
            if args.profile_level:
                level = args.profile_level
                args.out_dir.mkdir(parents=True, exist_ok=True)
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                prompts = bench_prompts(level)
                profile(
                    args.out_dir / f"offline-{level}.txt",
                    args.profile_s,
                    lambda: llm.generate(prompts, params),
                )
                profile(
                    args.out_dir / f"engine-process-{level}.txt",
                    args.profile_s,
                    lambda: closed_loop(engine, level, 4 * level, args.max_tokens),
                )
        finally:
            engine.shutdown()
        results: dict = {"rounds": rounds, "ratios": ratios(rounds, levels)}
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
    for level in levels:
        print(f"level {level:>4}, median of {args.rounds} rounds: {results['ratios'][level]}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
