"""Where a py-spy profile's time went, per process: the share of samples in each process, and within
each, the functions that were running (self time, the innermost frame) and those on the stack (total).

    python benchmarks/pyspy_top.py $OUT/overhead/off/py-spy-256.txt [--top 15]

Reads py-spy's collapsed stacks (`py-spy record --format raw --subprocesses`, as serving_overhead.py
records them: samples of running threads only, so the shares are where each process spent its CPU).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def summarize(path: Path, top: int) -> str:
    """The per-process tables, as text."""
    samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_process: collections.Counter = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = next((f for f in reversed(frames) if f.startswith("process ")), "process ?")[:110]
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        thread = next((f for f in frames if f.startswith("thread ")), "")
        per_process[process] += int(count)
        if code:
            samples[process][f"{thread[:40]} {code[-1]}"] += int(count)
            for frame in set(code):
                totals[process][frame] += int(count)
    lines = []
    everything = sum(per_process.values()) or 1
    for process, count in per_process.most_common():
        lines.append(f"\n## {count / everything:.0%} of samples: {process}")
        lines.append("self:")
        for frame, n in samples[process].most_common(top):
            lines.append(f"  {n / count:6.1%}  {frame}")
        lines.append("on the stack:")
        for frame, n in totals[process].most_common(top):
            lines.append(f"  {n / count:6.1%}  {frame}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in args.profile:
        print(f"# {path}")
        print(summarize(path, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
