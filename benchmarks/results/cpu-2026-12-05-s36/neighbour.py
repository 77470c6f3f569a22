"""Does a busy neighbour process slow the engine loop's host work (issue 18: served steps ~1.5x offline
in every host phase on the H200, with the server and the load generator beside the engine)?

    .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/neighbour.py 64 6

The tiny target through emulated CUDA graphs (host_costs.py), plain decoding, `batch` requests of 64
tokens, the engine pinned to CPU 0; on CPU 1, in turn: nothing, a pure-Python spin (a tiny working set),
a numpy loop streaming through 64 MB (more than the L3: evicts the engine's lines), and one through
1 MB (fits its own L2). Rounds alternate the neighbours; per neighbour the median ms a step and the
host pieces' us a step.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host_costs import CALLS, NANOSECONDS, _tiny_llm, _wrap_all  # noqa: E402

from dspark import SamplingParams  # noqa: E402

NEIGHBOURS = {
    "none": None,
    "spin": "x = 0\nwhile True:\n    x += 1\n",
    "mem64MB": "import numpy as np\na = np.ones(8 << 20)\nwhile True:\n    a += 1.0\n",
    "mem1MB": "import numpy as np\na = np.ones(1 << 17)\nwhile True:\n    a += 1.0\n",
}
PIECES = [
    "LLMEngine._complete",
    "Scheduler.schedule",
    "StaticLayout.fill",
    "llm_engine.pack_step",
    "LLMEngine._commit_tokens",
    "PendingDelta.make",
    "Captured.replay",
]


def main() -> None:
    batch, rounds = int(sys.argv[1]), int(sys.argv[2])
    os.sched_setaffinity(0, {0})
    _wrap_all()
    llm = _tiny_llm("off", batch)
    ids = [[(7 * i + j) % 500 + 1 for j in range(24)] for i in range(batch)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    results = {name: [] for name in NEIGHBOURS}
    pieces = {name: {p: [] for p in PIECES} for name in NEIGHBOURS}
    for _ in range(rounds):
        for name, code in NEIGHBOURS.items():
            proc = None
            if code is not None:
                proc = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", code])
                time.sleep(1.0)
            NANOSECONDS.clear()
            CALLS.clear()
            began = time.perf_counter()
            llm.generate(params=params, prompt_token_ids=ids)
            wall = time.perf_counter() - began
            steps = CALLS["LLMEngine.step"]
            results[name].append(wall / steps * 1e3)
            for p in PIECES:
                pieces[name][p].append(NANOSECONDS[p] / steps / 1e3)
            if proc is not None:
                proc.kill()
                proc.wait()
    base = statistics.median(results["none"])
    for name, walls in results.items():
        med = statistics.median(walls)
        parts = ", ".join(f"{p.split('.')[-1]} {statistics.median(v):.0f}" for p, v in pieces[name].items())
        print(f"{name:8s} {med:6.3f} ms/step ({med / base:.2f}x)  us/step: {parts}", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
