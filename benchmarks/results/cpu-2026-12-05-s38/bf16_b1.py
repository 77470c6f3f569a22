"""SmolLM2 on this CPU at batch 1 in fp32 and in bf16: plain, `static` (block 3) and the serve default,
`dspark-client bench`'s 8 questions one at a time (and, with `fresh`, the 24 fresh everyday questions),
64 greedy tokens, engines in one process, rounds alternated, median tokens/s and tokens a step.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/bf16_b1.py ROUNDS [fresh]
"""

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
pool = PROMPTS
if "fresh" in sys.argv[2:]:
    pool = [
        json.loads(x)["prompt"]
        for x in open(ROOT / "benchmarks/results/cpu-2026-12-04-s33/fresh_everyday_24.jsonl")
    ][:12]
engines = {}
for dtype in ("float32", "bfloat16"):
    engines[f"{dtype} plain"] = LLM(bench_config("", "", "cpu", 1, spec_mode="off", dtype=dtype))
    engines[f"{dtype} static 3"] = LLM(
        bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False, dtype=dtype)
    )
    engines[f"{dtype} default"] = LLM(bench_config("", "", "cpu", 1, dtype=dtype))
params = SamplingParams(max_tokens=64, ignore_eos=True)
first = next(iter(engines.values()))
qs = [[ids] for ids in _prompt_ids(first, len(pool), pool)]
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
for dtype in ("float32", "bfloat16"):
    base = statistics.median(rates[f"{dtype} plain"])
    for n, v in rates.items():
        if not n.startswith(dtype):
            continue
        m = statistics.median(v)
        same = sum(a == b for a, b in zip(outputs[n], outputs[f"{dtype} plain"], strict=True))
        print(
            f"{n:22s} {m:6.1f} tok/s {m / base:.3f}x plain  {statistics.median(per_step[n]):.2f} tok/step  "
            f"identical {same}/{len(qs)}  {[round(x, 1) for x in v]}",
            flush=True,
        )
agree = sum(a == b for a, b in zip(outputs["float32 plain"], outputs["bfloat16 plain"], strict=True))
print(f"bf16 plain vs fp32 plain identical: {agree}/{len(qs)}")
