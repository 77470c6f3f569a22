"""The aten operations a step issues outside its graph replays: the tiny engine of `host_ab_step.py`
(emulated graphs, launch-ahead), 20 steady steps counted with a dispatch mode that skips everything
inside `Captured.replay`; with WATCH ops, where in dspark each one comes from.

    .venv/bin/python benchmarks/results/cpu-2026-12-04-s31/count_step_ops.py static 8 [aten.to,aten.cat]

On the CPU, the reference twins of the kernels (greedy acceptance) show as several ops each; views
(slice, select, alias) launch nothing on a GPU.
"""

from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_ab_step import engine_for  # noqa: E402

import dspark.runner.cuda_graphs as cuda_graphs  # noqa: E402
from dspark import SamplingParams  # noqa: E402

STEPS = 20


class OutsideReplays(TorchDispatchMode):
    """Counts the ops dispatched while no captured graph replays (and where the watched ones are)."""

    def __init__(self, watch: set[str]) -> None:
        super().__init__()
        self.depth = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.places: collections.Counter[tuple[str, str]] = collections.Counter()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's hook
        if not self.depth:
            name = str(func.overloadpacket)
            self.counts[name] += 1
            if name in self.watch:
                frames = [f for f in traceback.extract_stack()[:-1] if "/dspark/" in f.filename]
                if frames:
                    where = (
                        f"{frames[-1].filename.split('/dspark/')[1]}:{frames[-1].lineno} {frames[-1].line}"
                    )
                    self.places[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    """Print the ops a step and, for the watched ones, their places."""
    mode, batch = sys.argv[1], int(sys.argv[2])
    counter = OutsideReplays(set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set())
    replay = cuda_graphs.Captured.replay

    def counted_replay(self: cuda_graphs.Captured) -> tuple:
        counter.depth += 1
        try:
            return replay(self)
        finally:
            counter.depth -= 1

    cuda_graphs.Captured.replay = counted_replay
    engine = engine_for(batch, mode)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [2 + (i * 7 + j) % 500 for j in range(8)], params)
    for _ in range(10):
        engine.step()
    with counter:
        for _ in range(STEPS):
            engine.step()
    print(f"{mode} batch {batch}: {sum(counter.counts.values()) / STEPS:.1f} aten ops a step outside replays")
    for name, count in counter.counts.most_common(30):
        print(f"  {count / STEPS:5.1f} {name}")
    for (name, where), count in counter.places.most_common(40):
        print(f"  {count / STEPS:5.1f} {name} {where}")


if __name__ == "__main__":
    main()
