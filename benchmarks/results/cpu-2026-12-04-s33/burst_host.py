"""Wall time per committed token with and without decode bursts: the tiny target (1 layer, hidden 32,
emulated CUDA graphs: the GPU path's buffers and host work, run eagerly on the CPU, whose compute is
in the figure too), B greedy requests decoding in MODE (off, or static without the gate), 48 steady
`LLMEngine.step` calls timed, engines interleaved, median of 5 rounds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/cpu-2026-12-04-s33/burst_host.py 64 1,4,8 [MODE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu-2026-12-04-s31"))
from host_ab_step import engine_for  # noqa: E402

from dspark import SamplingParams  # noqa: E402
from dspark.engine.llm_engine import LLMEngine  # noqa: E402

CALLS = 48


def run(engine: LLMEngine, batch: int, tag: str) -> float:
    """Microseconds of wall time per committed token over CALLS steady calls."""
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [2 + (i * 7 + j) % 500 for j in range(8)], params)
    for _ in range(6):
        engine.step()
    tokens = 0
    start = time.perf_counter()
    for _ in range(CALLS):
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    elapsed = time.perf_counter() - start
    for i in range(batch):
        engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return 1e6 * elapsed / tokens


def main() -> None:
    """Print per burst length the host microseconds per token (median, range) and per step."""
    batch, bursts = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
    mode = sys.argv[3] if len(sys.argv) > 3 else "off"
    torch.set_num_threads(1)
    engines = {}
    for burst in bursts:
        engine = engine_for(batch, mode)
        engine.config = engine.config.replace(decode_burst=burst)
        engine.gate = None  # bursts run under the gate too; this compares fixed lengths
        engines[burst] = engine
    times: dict[int, list[float]] = {b: [] for b in bursts}
    for r in range(6):
        for burst in bursts if r % 2 else reversed(bursts):
            us = run(engines[burst], batch, f"r{r}")
            if r:  # the first round warms up
                times[burst].append(us)
    base = statistics.median(times[bursts[0]])
    for burst in bursts:
        med = statistics.median(times[burst])
        low, high = min(times[burst]), max(times[burst])
        print(
            f"b{batch} {mode} decode_burst {burst}: {med:.2f} us a token ({low:.2f}-{high:.2f}),"
            f" {med * batch / 1e3:.3f} ms a step of {batch} tokens, x{base / med:.2f}"
        )


if __name__ == "__main__":
    main()
