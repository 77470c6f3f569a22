"""`static` at blocks 3 (shipped), 4, 5 and 7 (the shipped drafter was trained at 7: a copy of it whose
config says 7, the temperatures past 3 set to 1, which `static` does not read) against plain decoding
and the serve default, SmolLM2 fp32 on this CPU, `dspark-client bench`'s 8 questions one at a time, 64
greedy tokens, engines in one process, rounds alternated, median tokens/s and tokens a step.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s37/block_sizes_b1.py 2
"""

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "client")]
from e2e import _prompt_ids, bench_config  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
block7 = Path(tempfile.mkdtemp()) / "drafter7"
shutil.copytree(ROOT / "drafters/SmolLM2-135M-Instruct-dspark", block7)
config = json.loads((block7 / "config.json").read_text())
config["block_size"] = 7
config["confidence_temperatures"] += [1.0] * (7 - len(config["confidence_temperatures"]))
(block7 / "config.json").write_text(json.dumps(config))
D7 = str(block7)
engines = {"off": LLM(bench_config("", "", "cpu", 1, spec_mode="off"))}
engines["static 3 (shipped)"] = LLM(
    bench_config("", "", "cpu", 1, spec_mode="static", adaptive_speculation=False)
)
for b in (4, 5, 7):
    engines[f"static {b}"] = LLM(
        bench_config("", D7, "cpu", 1, spec_mode="static", adaptive_speculation=False, block_size=b)
    )
engines["default (shipped, block 3)"] = LLM(bench_config("", "", "cpu", 1))
engines["default, block 7"] = LLM(bench_config("", D7, "cpu", 1))
params = SamplingParams(max_tokens=64, ignore_eos=True)
qs = [[ids] for ids in _prompt_ids(engines["off"], 8, PROMPTS)]
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=qs[0])
rates = {n: [] for n in engines}
per_step = {n: [] for n in engines}
for _ in range(rounds):
    for name, llm in engines.items():
        toks, secs = 0, 0.0
        s0 = llm.engine.load().loop.steps
        for q in qs:
            t = time.perf_counter()
            o = llm.generate(params=params, prompt_token_ids=q)
            secs += time.perf_counter() - t
            toks += len(o[0].token_ids)
        rates[name].append(toks / secs)
        per_step[name].append(toks / (llm.engine.load().loop.steps - s0))
base = statistics.median(rates["off"])
for n, v in rates.items():
    m = statistics.median(v)
    print(
        f"{n:28s} {m:6.1f} tok/s {m / base:.3f}x plain  {statistics.median(per_step[n]):.2f} tok/step  "
        f"{[round(x, 1) for x in v]}",
        flush=True,
    )
