"""Session 46: the CPU step's host layout (AttentionBatch.host_windows) on and off, alternated round by
round in one engine. `python one_window_ab.py off|static [batch]`."""

import dataclasses
import statistics
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config

import dspark.runner.attention_batch as ab
from dspark import LLM, SamplingParams

orig_build = ab.AttentionBatch.build.__func__
state = {"on": True}


def build(cls, *a, **k):
    b = orig_build(cls, *a, **k)
    return b if state["on"] else dataclasses.replace(b, one_window=None)


ab.AttentionBatch.build = classmethod(build)
mode = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1
llm = LLM(bench_config("", "", "cpu", n, spec_mode=mode))
ids = _prompt_ids(llm, n)
p = SamplingParams(max_tokens=96, ignore_eos=True)
llm.generate(params=p, prompt_token_ids=ids)
res = {"base": [], "new": []}
toks = {}
for r in range(8):
    for v in ["base", "new"] if r % 2 == 0 else ["new", "base"]:
        state["on"] = v == "new"
        s = time.perf_counter()
        o = llm.generate(params=p, prompt_token_ids=ids)
        res[v].append(time.perf_counter() - s)
        toks[v] = [x.token_ids for x in o]
for v in res:
    print(
        mode,
        v,
        "median tok/s",
        round(96 * n / statistics.median(res[v]), 2),
        [round(96 * n / t, 1) for t in res[v]],
    )
print("same tokens", toks["base"] == toks["new"])
