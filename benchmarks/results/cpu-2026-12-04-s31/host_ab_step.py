"""Host ms a step outside the target step, by phase: a tiny target with emulated CUDA graphs (the GPU
path's buffers and launch-ahead, run eagerly), B requests decoding, 60 steady steps, median of 5 runs.

    python host_ab_step.py B MODE            # MODE: off | static | compact
    python host_ab_step.py B MODE prof       # cProfile of one run instead (SORT=cumulative, CALLEES=regex)

Session 31 ran it for two trees in alternating processes (`host_ab.sh`): PYTHONPATH picks the tree.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_models import tiny_engine_config, use_emulated_graphs, write_tiny_drafter, write_tiny_target  # noqa: E402

from dspark import SamplingParams  # noqa: E402
from dspark.engine.llm_engine import LLMEngine  # noqa: E402

STEPS = 60


def engine_for(batch: int, mode: str) -> LLMEngine:
    """The tiny engine at `batch` requests, its steps replayed from emulated graphs."""
    root = Path("/tmp/host-ab-models")
    target, drafter = root / "t", root / "d"
    if not target.exists():
        write_tiny_target(target, vocab_size=512, hidden=32, layers=1)
        write_tiny_drafter(target, drafter, block_size=3)
    config = tiny_engine_config(
        target,
        drafter if mode != "off" else None,
        spec_mode=mode,
        num_kv_pages=4096,
        max_num_seqs=batch,
        max_num_batched_tokens=max(64, 4 * batch),
    )
    engine = LLMEngine(config)
    return use_emulated_graphs(engine, tokens=max(64, 4 * batch), requests=batch)


def run(engine: LLMEngine, batch: int, tag: int) -> dict[str, float]:
    """Host ms a step by phase over STEPS steady steps of `batch` fresh requests."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{tag}-{i}", [2 + (i * 7 + j) % 500 for j in range(8)], params)
    for _ in range(10):  # prompts in, decoding under way
        engine.step()
    before = dict(vars(engine.loop_counters))
    for _ in range(STEPS):
        engine.step()
    after = vars(engine.loop_counters)
    phases = {k[5:-8]: 1e3 * (after[k] - before[k]) / STEPS for k in after if k.startswith("host_")}
    while engine.has_unfinished_requests():
        engine.step()
    return phases


def main() -> None:
    """Print the median run's phases (or a cProfile of one run)."""
    batch, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)  # the target's compute is not what is timed
    engine = engine_for(batch, mode)
    run(engine, batch, 0)  # warm-up
    if len(sys.argv) > 3 and sys.argv[3] == "prof":
        profile = cProfile.Profile()
        profile.enable()
        run(engine, batch, 1)
        profile.disable()
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out).sort_stats(os.environ.get("SORT", "tottime"))
        stats.print_stats(60)
        if os.environ.get("CALLEES"):
            stats.print_callees(os.environ["CALLEES"])
        print(out.getvalue())
        return
    runs = []
    for tag in range(1, 6):
        phases = run(engine, batch, tag)
        outside = {k: round(v, 3) for k, v in phases.items() if k != "target"}
        runs.append((sum(outside.values()), outside))
    runs.sort(key=lambda r: r[0])
    total, phases = runs[len(runs) // 2]
    start = time.strftime("%H:%M:%S")
    print(f"{start} b{batch} {mode}: host-non-target {total:.3f} ms/step {phases}")


if __name__ == "__main__":
    main()
