"""How long the cyclic garbage collector holds the engine loop, with the startup heap frozen or not.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/cpu-2026-12-05-s35/gc_cost.py 256 off freeze

(or nofreeze). The tiny target through emulated CUDA graphs (benchmarks/host_costs.py), batch B, 64
greedy tokens a generate(); per round the collections of each generation and their total pause
(gc.callbacks).
"""

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host_costs import _tiny_llm  # noqa: E402

from dspark import SamplingParams  # noqa: E402


def main() -> None:
    """Three timed rounds after a warm-up, the collections' counts and pauses per round."""
    batch, mode, freeze = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "freeze"
    llm = _tiny_llm(mode, batch)
    ids = [[(7 * i + j) % 500 + 1 for j in range(24)] for i in range(batch)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    if freeze:
        gc.collect()
        gc.freeze()
    pauses = {generation: [0, 0.0] for generation in range(3)}
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pause = pauses[info["generation"]]
            pause[0] += 1
            pause[1] += time.perf_counter() - started[0]

    gc.callbacks.append(on_collection)
    print("tracked objects", len(gc.get_objects()), "frozen", gc.get_freeze_count())
    for round_ in range(3):
        for pause in pauses.values():
            pause[:] = [0, 0.0]
        began = time.perf_counter()
        llm.generate(params=params, prompt_token_ids=ids)
        wall = time.perf_counter() - began
        each = ", ".join(f"gen{g}: {n} x, {s * 1e3:.1f} ms" for g, (n, s) in pauses.items())
        print(f"round {round_}: wall {wall * 1e3:.0f} ms, gc {each}")
    llm.close()


if __name__ == "__main__":
    main()
