"""Session 61: plain decoding, the serve default's engine held at plain steps (gated-plain) and the serve
default, built in that order in one process, 4 alternating rounds of N requests x 64 tokens (CPU).

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s61/plain_steps_side_by_side.py 8
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
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    engines = {}
    for mode in ["off", "gated-plain", "default"]:
        gated = mode == "gated-plain"
        fields = {} if mode == "default" else {"spec_mode": "static" if gated else "off"}
        if mode != "default":
            fields["adaptive_speculation"] = gated
        draft = args.draft_model if mode != "off" else ""
        llm = LLM(e2e.bench_config(args.model, draft, "cpu", batch, **fields))
        if gated:
            llm.engine.gate.draft_length = lambda num_requests, draining=None: 0
        engines[mode] = llm
    ids = e2e._prompt_ids(engines["off"], batch)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for llm in engines.values():
        llm.generate(params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=ids)
    times: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(4):
        for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            engines[mode].generate(params=params, prompt_token_ids=ids)
            times[mode].append(time.perf_counter() - start)
    for mode, seconds in times.items():
        median = statistics.median(seconds)
        rounded = [round(t, 2) for t in seconds]
        print(mode, f"median s {median:.3f}", f"tok/s {batch * 64 / median:.1f}", rounded)


if __name__ == "__main__":
    main()
