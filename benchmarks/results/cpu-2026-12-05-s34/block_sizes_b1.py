"""`static` at block sizes 1, 2 and 3 against plain decoding and the serve default (the gate over a block of
3), SmolLM2 fp32 on this CPU, `dspark-client bench`'s 8 questions one at a time, 64 greedy tokens, two
rounds (engines in one process, rounds alternated), median tokens/s.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s34/block_sizes_b1.py
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

engines = {"off": LLM(bench_config("", "", "cpu", 1, spec_mode="off"))}
for block in (1, 2, 3):
    engines[f"static, block {block}"] = LLM(
        bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False, block_size=block)
    )
engines["serve default"] = LLM(bench_config("", "", "cpu", 1))
params = SamplingParams(max_tokens=64, ignore_eos=True)
questions = [[ids] for ids in _prompt_ids(engines["off"], 8, PROMPTS)]
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=questions[0])
rates: dict[str, list[float]] = {name: [] for name in engines}
per_step: dict[str, float] = {}
for _ in range(2):
    for name, llm in engines.items():
        start, tokens, steps = time.perf_counter(), 0, 0
        for ids in questions:
            out = llm.generate(params=params, prompt_token_ids=ids)[0]
            tokens, steps = tokens + len(out.token_ids), steps + out.spec_stats.steps
        rates[name].append(tokens / (time.perf_counter() - start))
        per_step[name] = tokens / steps
plain = statistics.median(rates["off"])
for name in engines:
    rate = statistics.median(rates[name])
    print(f"{name:16s} {rate:6.2f} tok/s  {rate / plain:5.3f}x plain  {per_step[name]:.2f} tokens a step")
