"""How long a CPU engine's load takes and how much of it measures the product paths (session 63).

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s63/load_time.py   # run twice: measured, then taken

Run from the checkout's root after `make setup`."""

import time

t0 = time.perf_counter()
import dspark.runner.models.layers as layers  # noqa: E402
from dspark import LLM  # noqa: E402
from dspark.config import EngineConfig  # noqa: E402

measure = layers._measure
spent: list[float] = []


def timed(*args, **kwargs):
    start = time.perf_counter()
    result = measure(*args, **kwargs)
    spent.append(time.perf_counter() - start)
    return result


layers._measure = timed
t1 = time.perf_counter()
TARGET, DRAFTER = "models/SmolLM2-135M-Instruct", "drafters/SmolLM2-135M-Instruct-dspark"
LLM(EngineConfig(model=TARGET, draft_model=DRAFTER, device="cpu"))
t2 = time.perf_counter()
print(f"import {t1 - t0:.1f}s, LLM() {t2 - t1:.1f}s, measuring {sum(spent):.1f}s ({len(spent)} calls)")
