"""Session 61: one engine injecting every step's features, one deferring them (`defer_inject`), in one
process, alternating rounds of N requests x 64 tokens (CPU); `swap` builds the other first (the first
engine built ran ~3.5% slower whichever it was).

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s61/deferred_inject_side_by_side.py 8 default 6 [swap]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import e2e  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    e2e.add_engine_arguments(parser, max_tokens=64)
    args = parser.parse_args(["--device", "cpu"])
    batch, mode = int(sys.argv[1]), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    engines = {}
    for name in ["each-step", "defer"] if "swap" in sys.argv else ["defer", "each-step"]:
        fields = {} if mode == "default" else {"spec_mode": mode, "adaptive_speculation": False}
        llm = LLM(e2e.bench_config(args.model, args.draft_model, "cpu", batch, **fields))
        llm.engine.proposer.defer_inject = name == "defer"
        engines[name] = llm
    ids = e2e._prompt_ids(engines["defer"], batch)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for llm in engines.values():
        llm.generate(params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=ids)
    times: dict[str, list[float]] = {m: [] for m in engines}
    outs = {}
    for r in range(rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            result = engines[name].generate(params=params, prompt_token_ids=ids)
            times[name].append(time.perf_counter() - start)
            outs[name] = [o.token_ids for o in result]
    for name, seconds in times.items():
        rate = batch * 64 / statistics.median(seconds)
        print(mode, batch, name, f"tok/s {rate:.1f}", [round(t, 2) for t in seconds])
    print("identical", outs["defer"] == outs["each-step"])


if __name__ == "__main__":
    main()
