"""Does the host's Python run slower while the machine's other cores are busy? The served engine's host
phases measured 1.5-2x their offline time on the H200 host (issue 18), in every phase, pure-Python ones
too, at one stream as at 64; the offline engine runs on an otherwise idle machine, the served one beside
tritonserver, the backend stub and the load generator. This times a fixed pure-Python loop and a fixed
loop of small host torch ops (the kind a step is made of) in this process while 0, 4, 8, ... other
processes spin on the remaining cores, and beside a sibling thread of this process that wakes every
millisecond for a burst of Python (as the engine process's sender does), side by side in one run.

    python benchmarks/host_contention.py --busy 0,4,8,15 --out /tmp/contention.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path

import torch


def spin(stop: mp.Event) -> None:  # type: ignore[valid-type]
    """Keep one core busy until asked to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def python_loop() -> float:
    """Seconds of a fixed pure-Python loop (dicts, lists, attribute reads: the engine's bookkeeping)."""
    started = time.perf_counter()
    table: dict[int, list[int]] = {}
    for i in range(200_000):
        table.setdefault(i & 255, []).append(i)
        if len(table[i & 255]) > 8:
            table[i & 255].clear()
    return time.perf_counter() - started


def torch_loop() -> float:
    """Seconds of a fixed loop of small host torch ops (a step's window numbers, cumsums, cats)."""
    started = time.perf_counter()
    lens = [3] * 64
    for _ in range(2_000):
        t = torch.tensor(lens, dtype=torch.long)
        cu = torch.zeros(65, dtype=torch.long)
        cu[1:] = torch.cumsum(t + 1, 0)
        torch.cat([cu, t, t])
    return time.perf_counter() - started


def sender_like(stop: threading.Event) -> None:
    """Wake every millisecond and run ~0.1 ms of Python, until asked to stop."""
    while not stop.wait(0.001):
        python_burst()


def python_burst() -> None:
    """About a tenth of a millisecond of pure Python."""
    items = [(i, str(i)) for i in range(300)]
    {key: value for key, value in items}


def report(label: str, row: dict, base: dict) -> None:
    """One line: both loops' times and their ratio to the first row's."""
    print(
        f"{label}: python {row['python_s'] * 1e3:7.2f} ms ({row['python_s'] / base['python_s']:.2f}x), "
        f"torch ops {row['torch_s'] * 1e3:7.2f} ms ({row['torch_s'] / base['torch_s']:.2f}x)",
        flush=True,
    )


def measure(repeats: int) -> dict[str, float]:
    """Median seconds of each loop over `repeats` runs."""
    return {
        "python_s": statistics.median(python_loop() for _ in range(repeats)),
        "torch_s": statistics.median(torch_loop() for _ in range(repeats)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", default="0,4,8,15", help="other processes spinning, per measurement")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # this process on one core, the spinners on the others
    measure(2)  # warm-up
    rows = []
    for busy in (int(b) for b in args.busy.split(",")):
        stop = mp.Event()
        spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
        for index, process in enumerate(spinners):
            process.start()
            os.sched_setaffinity(process.pid, {cpus[1 + index % max(len(cpus) - 1, 1)]})
        time.sleep(1.0)  # let clocks settle under the new load
        row = {"busy_processes": busy, **measure(args.repeats)}
        stop.set()
        for process in spinners:
            process.join(5)
        rows.append(row)
        report(f"{busy:>3} busy processes", row, rows[0])
        time.sleep(1.0)
    # The engine process's own sibling: a thread that wakes every millisecond for ~0.1 ms of Python
    # (the sender packing a step's deltas), contending for this process's GIL, not for a core.
    stop_thread = threading.Event()
    sibling = threading.Thread(target=sender_like, args=(stop_thread,), daemon=True)
    sibling.start()
    row = {"busy_processes": 0, "sibling_thread": True, **measure(args.repeats)}
    stop_thread.set()
    sibling.join()
    rows.append(row)
    report("  a sibling thread", row, rows[0])
    if args.out is not None:
        args.out.write_text(json.dumps({"cpus": len(cpus), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
