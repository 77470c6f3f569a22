"""Prompt lookup on and off, SmolLM2 fp32 on this CPU at batch 1: plain, `static` (block 3) and the
serve default, one question at a time, 64 greedy tokens (96 with `long`), engines in one process,
rounds alternated, median tokens/s and tokens a step. Prompt sets: `bench` (`dspark-client bench`'s 8
questions), `fresh` (the 24 fresh everyday questions, never trained on), `eval` (8 a domain of
training/prompts_eval.jsonl, held out by source).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/lookup_b1.py ROUNDS SET [long]
"""

import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "client")]
from e2e import _prompt_ids, bench_config  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
which = sys.argv[2] if len(sys.argv) > 2 else "bench"
max_tokens = 96 if "long" in sys.argv[3:] else 64
if which == "bench":
    pool = PROMPTS
elif which == "fresh":
    pool = [
        json.loads(x)["prompt"]
        for x in open(ROOT / "benchmarks/results/cpu-2026-12-04-s33/fresh_everyday_24.jsonl")
    ]
else:
    by = collections.defaultdict(list)
    for line in open(ROOT / "training/prompts_eval.jsonl"):
        p = json.loads(line)
        by[p["domain"]].append(p["prompt"])
    pool = [p for d in sorted(by) for p in by[d][8:12]]  # not tree_potential's first 8
engines = {
    "plain": LLM(bench_config("", "", "cpu", 1, spec_mode="off")),
    "static, lookup off": LLM(
        bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False, prompt_lookup=False)
    ),
    "static, lookup on": LLM(bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False)),
    "default, lookup off": LLM(bench_config("", "", "cpu", 1, prompt_lookup=False)),
    "default, lookup on": LLM(bench_config("", "", "cpu", 1)),
}
params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
qs = [[ids] for ids in _prompt_ids(engines["plain"], len(pool), pool)]
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=qs[0])
rates = {n: [] for n in engines}
per_step = {n: [] for n in engines}
outputs = {n: [] for n in engines}
for rnd in range(rounds):
    for name, llm in engines.items():
        toks, secs = 0, 0.0
        s0 = llm.engine.load().loop.steps
        for q in qs:
            t = time.perf_counter()
            o = llm.generate(params=params, prompt_token_ids=q)
            secs += time.perf_counter() - t
            toks += len(o[0].token_ids)
            if rnd == 0:
                outputs[name].append(list(o[0].token_ids))
        rates[name].append(toks / secs)
        per_step[name].append(toks / (llm.engine.load().loop.steps - s0))
base = statistics.median(rates["plain"])
print(f"{which}: {len(qs)} questions, {max_tokens} greedy tokens, {rounds} rounds")
for n, v in rates.items():
    m = statistics.median(v)
    same = sum(a == b for a, b in zip(outputs[n], outputs["plain"], strict=True))
    print(
        f"{n:22s} {m:6.1f} tok/s {m / base:.3f}x plain  {statistics.median(per_step[n]):.2f} tok/step  "
        f"identical {same}/{len(qs)}  {[round(x, 1) for x in v]}",
        flush=True,
    )
