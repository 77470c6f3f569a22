"""The serve default and plain decoding at batch 1 (dspark-client bench's 8 prompts, 32 tokens), with the
CPU linear paths measured per row count (new) and with the weight first for 2-16 rows (old), four
engines alive in one process, rounds interleaved. Run from the repository root."""

import time

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.models import layers
from dspark_client.bench import PROMPTS  # dspark-client bench's prompts

OLD = layers.CpuLinearPaths().by_rows


def mk(**kw):
    return LLM(EngineConfig(**kw))


engines = {
    "plain": mk(spec_mode="off"),
    "default": mk(),
    "plain_old": mk(spec_mode="off"),
    "default_old": mk(),
}
NEW = layers.CPU_LINEAR_PATHS.by_rows
OLD = (NEW[0],) + OLD[1:]
print("measured", NEW)
params = SamplingParams(max_tokens=32, ignore_eos=True)


def use(name):
    layers.CPU_LINEAR_PATHS.by_rows = OLD if name.endswith("_old") else NEW


for name, llm in engines.items():
    use(name)
    llm.generate(PROMPTS[0], params)
times = {k: [] for k in engines}
for _rnd in range(3):
    for name, llm in engines.items():
        use(name)
        t = time.perf_counter()
        [llm.generate(p, params)[0] for p in PROMPTS]
        times[name].append(time.perf_counter() - t)
tok = 32 * len(PROMPTS)
print({k: [round(tok / x, 1) for x in v] for k, v in times.items()})
for a, b in (("default", "plain"), ("default_old", "plain_old"), ("plain", "plain_old")):
    print(f"{a}/{b}", [round(y / x, 2) for x, y in zip(times[a], times[b], strict=False)])
