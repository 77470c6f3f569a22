"""What a step that carries a prefill chunk costs the host, against a decode-only step (issue 18).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/arrivals.py 64 off

The tiny target through emulated CUDA graphs (benchmarks/host_costs.py's timers), `batch` requests in
flight. Two load shapes over the same number of committed tokens:
- together: every request arrives at once and ends together (the offline engine's batch);
- rolling: a closed loop whose requests end one or two a step (their lengths staggered) and are
  replaced at once by a new request, as served streams restart (most steps then carry a prefill chunk).
Per step class (decode-only, with a prefill chunk) the mean wall time and each timed piece's
microseconds per step.
"""

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host_costs import CALLS, NANOSECONDS, _tiny_llm, _wrap_all  # noqa: E402

import dspark.engine.scheduler as scheduler  # noqa: E402
from dspark import SamplingParams  # noqa: E402

LAST = {"prefill": 0}


def _note_prefill() -> None:
    schedule = scheduler.Scheduler.schedule

    def wrapped(self, *args, **kwargs):  # noqa: ANN001, ANN202
        out = schedule(self, *args, **kwargs)
        LAST["prefill"] += len(out.prefill)
        return out

    scheduler.Scheduler.schedule = wrapped


def run(llm, batch: int, shape: str, steps: int, max_tokens: int) -> dict:
    engine = llm.engine
    counter = [0]

    def add(length: int) -> None:
        counter[0] += 1
        ids = [(7 * counter[0] + j) % 500 + 1 for j in range(24)]
        engine.add_request(f"r{counter[0]}", ids, SamplingParams(max_tokens=length, ignore_eos=True))

    if shape == "together":
        for _ in range(batch):
            add(max_tokens)
    else:
        for i in range(batch):  # staggered: about batch / max_tokens requests end a step
            add(1 + (i * max_tokens) // batch)
    classes: dict[str, list] = {
        "decode": [0, 0.0, collections.Counter()],
        "prefill": [0, 0.0, collections.Counter()],
    }
    for _ in range(steps):
        if shape == "together" and not engine.has_unfinished_requests():
            for _ in range(batch):
                add(max_tokens)
        before = dict(NANOSECONDS)
        LAST["prefill"] = 0
        began = time.perf_counter_ns()
        deltas = engine.step()
        wall = time.perf_counter_ns() - began
        kind = "prefill" if LAST["prefill"] else "decode"
        entry = classes[kind]
        entry[0] += 1
        entry[1] += wall
        for label, ns in NANOSECONDS.items():
            entry[2][label] += ns - before.get(label, 0)
        if shape == "rolling":
            for delta in deltas:
                if delta.finished:
                    add(max_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    return classes


def main() -> None:
    batch, mode = int(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    _wrap_all()
    _note_prefill()
    llm = _tiny_llm(mode, batch)
    run(llm, batch, "together", 80, max_tokens)  # warm-up
    run(llm, batch, "rolling", 80, max_tokens)
    for shape in ("together", "rolling", "together", "rolling"):
        NANOSECONDS.clear()
        CALLS.clear()
        classes = run(llm, batch, shape, steps, max_tokens)
        for kind, (n, wall, pieces) in classes.items():
            if not n:
                continue
            print(f"== {shape} {mode} b{batch} {kind}: {n} steps, {wall / n / 1e3:.0f} us/step")
            for label, ns in sorted(pieces.items(), key=lambda kv: -kv[1])[:24]:
                print(f"   {label:36s} {ns / n / 1e3:8.1f} us/step")
    llm.close()


if __name__ == "__main__":
    main()
