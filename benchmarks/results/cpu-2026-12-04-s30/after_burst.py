"""Session 30, issue 18: does an engine that has served a 256-request burst step slower afterwards?

Two engines built alike (the tiny random target of `benchmarks/host_costs.py --tiny`: the host's work
dominates its steps, through emulated CUDA graphs, plain decoding, room for 256 requests). One first
serves a burst of 256 requests; then both serve the same 8 requests in turn, several rounds, and the
host milliseconds per step of each are printed side by side.

    cd benchmarks && ../.venv/bin/python results/cpu-2026-12-04-s30/after_burst.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import host_costs  # noqa: E402

from dspark import SamplingParams  # noqa: E402

ROUNDS = 6


def per_step_ms(llm, prompts, max_tokens: int) -> float:
    """Wall ms per engine step of one generate() over `prompts`."""
    before = llm.engine.load().loop.steps
    start = time.perf_counter()
    llm.generate(params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt_token_ids=prompts)
    steps = llm.engine.load().loop.steps - before
    return 1e3 * (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    fresh, burst = host_costs._tiny_llm("off", 256), host_costs._tiny_llm("off", 256)
    small = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(8)]
    big = [[1 + (i * 13 + j) % 500 for j in range(16)] for i in range(256)]
    per_step_ms(fresh, small, 8)  # warm-ups, alike
    per_step_ms(burst, small, 8)
    print(f"burst: {per_step_ms(burst, big, 64):.3f} ms a step at 256 requests")
    rows = []
    for round_ in range(ROUNDS):
        if round_ % 2:  # each engine goes first in half of the rounds
            after = per_step_ms(burst, small, 64)
            pair = [per_step_ms(fresh, small, 64), after]
        else:
            pair = [per_step_ms(fresh, small, 64), per_step_ms(burst, small, 64)]
        rows.append(pair)
        ratio = pair[1] / pair[0]
        print(f"round {round_}: fresh {pair[0]:.3f} ms, after the burst {pair[1]:.3f} ms ({ratio:.2f}x)")
    ratios = [b / f for f, b in rows]
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    print(f"median after-burst / fresh: {statistics.median(ratios):.3f} (range {spread})")


if __name__ == "__main__":
    main()
