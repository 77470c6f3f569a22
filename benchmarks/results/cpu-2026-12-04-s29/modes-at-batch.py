"""Plain, the serve default and `compact` with a profiled SPS table (sync and lagged planners), batch size
from the command line (dspark-client bench's 8 prompts, 32 greedy tokens, two interleaved rounds).
Run from the repository root: python benchmarks/results/cpu-2026-12-04-s29/modes-at-batch.py 4"""

import sys
import time

from dspark import LLM, EngineConfig, SamplingParams
from dspark_client.bench import PROMPTS

batch = int(sys.argv[1])


def mk(**kw):
    return LLM(EngineConfig(**kw))


engines = {
    "plain": mk(spec_mode="off"),
    "default": mk(),
    "compact_prof": mk(spec_mode="compact", adaptive_speculation=False, sps_table="profile"),
    "compact_prof_lagged": mk(
        spec_mode="compact", adaptive_speculation=False, sps_table="profile", planner_policy="lagged"
    ),
}
print(
    {
        k: [(p.tokens, round(p.steps_per_second, 1)) for p in e.engine.planner.sps.points]
        for k, e in engines.items()
        if k.startswith("compact")
    }
)
params = SamplingParams(max_tokens=32, ignore_eos=True)
for llm in engines.values():
    llm.generate(PROMPTS[:batch], params)
times = {k: [] for k in engines}
same = {}
taus = {}
for _rnd in range(2):
    for name, llm in engines.items():
        t = time.perf_counter()
        outs = []
        for i in range(0, 8, batch):
            outs += llm.generate(PROMPTS[i : i + batch], params)
        times[name].append(time.perf_counter() - t)
        ids = [o.token_ids for o in outs]
        if name == "plain":
            ref = ids
        same[name] = ids == ref
        st = [o.spec_stats for o in outs]
        taus[name] = round(sum(s.accepted_tokens + s.steps for s in st) / sum(s.steps for s in st), 2)
print({k: [round(256 / x, 1) for x in v] for k, v in times.items()})
print(
    {k: [round(p / x, 2) for p, x in zip(times["plain"], v, strict=False)] for k, v in times.items()},
    same,
    taus,
)
