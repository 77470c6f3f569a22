"""The serve default's gate against `static` at its block (3) and plain decoding at batch 1, SmolLM2 fp32
on this CPU, `dspark-client bench`'s 8 questions one at a time, 64 greedy tokens, rounds alternated;
then what the gate measured and chose (rates per draft length, steps per length).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/gate_b1.py 4
"""

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "client")]
from e2e import _prompt_ids, bench_config  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
engines = {
    "off": LLM(bench_config("", "", "cpu", 1, spec_mode="off")),
    "static 3": LLM(bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False)),
    "serve default": LLM(bench_config("", "", "cpu", 1)),
}
params = SamplingParams(max_tokens=64, ignore_eos=True)
questions = [[ids] for ids in _prompt_ids(engines["off"], 8, PROMPTS)]
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=questions[0])
rates: dict[str, list[float]] = {name: [] for name in engines}
steps: dict[str, int] = dict.fromkeys(engines, 0)
for _ in range(rounds):
    for name, llm in engines.items():
        tokens, seconds = 0, 0.0
        before = llm.engine.load().loop.steps
        for ids in questions:
            started = time.perf_counter()
            out = llm.generate(params=params, prompt_token_ids=ids)
            seconds += time.perf_counter() - started
            tokens += len(out[0].token_ids)
        steps[name] += llm.engine.load().loop.steps - before
        rates[name].append(tokens / seconds)
base = statistics.median(rates["off"])
for name, values in rates.items():
    median = statistics.median(values)
    each = ", ".join(f"{v:.1f}" for v in values)
    print(f"{name:14s} {median:6.2f} tok/s  {median / base:.3f}x plain  ({each})")
gate = engines["serve default"].engine.gate
print(
    "gate rates at 1 request (tokens/s by draft length):", {n: round(r, 1) for n, r in gate.rates(1).items()}
)
tier = gate._tiers.get(1) if hasattr(gate, "_tiers") else None
if tier is not None:
    print("steps chosen by length:", dict(tier.chosen))
    print(
        "step seconds (median of latest) by length:",
        {n: round(s.value * 1e3, 2) for n, s in tier.seconds.items()},
    )
