"""The serve default's gate at batch 1 on this CPU, step by step: each change of draft length (and every
100th step) with the gate's rates and median step times then (bench questions, 64 tokens, 3 rounds).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/gate_trace.py
"""

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "client")]
from e2e import _prompt_ids, bench_config  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

llm = LLM(bench_config("", "", "cpu", 1))
gate = llm.engine.gate
choose = gate.draft_length
trace = []


def traced(num_requests: int) -> int:
    """The gate's choice, with what it knew when it made it."""
    length = choose(num_requests)
    stats = gate._tiers.get(1)
    rates = {k: round(v, 1) for k, v in gate.rates(1).items()}
    seconds = {k: round(s.value * 1e3, 1) for k, s in stats.seconds.items()} if stats else {}
    trace.append((length, rates, seconds, gate._run is not None and gate._run.probe))
    return length


gate.draft_length = traced
params = SamplingParams(max_tokens=64, ignore_eos=True)
questions = [[ids] for ids in _prompt_ids(llm, 8, PROMPTS)]
for _ in range(3):
    for ids in questions:
        llm.generate(params=params, prompt_token_ids=ids)
previous = None
for i, (length, rates, seconds, probe) in enumerate(trace):
    if length != previous or i % 100 == 0:
        print(i, length, "probe" if probe else "", "rates", rates, "step ms", seconds)
    previous = length
print(collections.Counter(t[0] for t in trace))
