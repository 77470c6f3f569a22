"""Where a batch-1 step's time goes on this CPU, plain against `static` (block 3): torch.profiler over
one generate() of 48 greedy tokens each, ops by self CPU time a step.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s38/step_ops_b1.py
"""

import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "client")]
from e2e import _prompt_ids, bench_config  # noqa: E402
from prompts import PROMPTS  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402

DTYPE = sys.argv[1] if len(sys.argv) > 1 else "float32"
rows = {}
for mode in ("off", "static"):
    llm = LLM(bench_config("", "", "cpu", 1, spec_mode=mode, adaptive_speculation=False, dtype=DTYPE))
    ids = _prompt_ids(llm, 1, PROMPTS[2:3])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    llm.generate(params=params, prompt_token_ids=ids)
    s0 = llm.engine.load().loop.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(params=params, prompt_token_ids=ids)
    steps = llm.engine.load().loop.steps - s0
    table = {e.key: (e.self_cpu_time_total / steps / 1000, e.count / steps) for e in prof.key_averages()}
    total = sum(v[0] for v in table.values())
    rows[mode] = (table, steps, total)
    print(f"{mode}: {steps} steps, ops' self time {total:.2f} ms a step", flush=True)
    llm.close()
keys = sorted(
    set(rows["off"][0]) | set(rows["static"][0]),
    key=lambda k: -(rows["static"][0].get(k, (0, 0))[0] - rows["off"][0].get(k, (0, 0))[0]),
)
print(f"{'op':45s} {'plain ms':>9s} {'calls':>6s} {'static ms':>9s} {'calls':>6s} {'diff':>7s}")
for k in keys[:30] + keys[-12:]:
    a = rows["off"][0].get(k, (0.0, 0.0))
    b = rows["static"][0].get(k, (0.0, 0.0))
    print(f"{k[:45]:45s} {a[0]:9.3f} {a[1]:6.1f} {b[0]:9.3f} {b[1]:6.1f} {b[0] - a[0]:7.3f}")
