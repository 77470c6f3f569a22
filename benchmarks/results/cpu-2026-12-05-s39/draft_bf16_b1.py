"""A try, not kept: the serve default with its drafter in bf16 on the CPU (the drafter and its head rows
cast; the target stays fp32), beside plain and the fp32 drafter, batch 1, chat-formatted prompts, 64 tokens.
Run from the repository root: OMP_NUM_THREADS=2 .venv/bin/python <this file> bench 3"""

import sys

import torch

sys.path.insert(0, "benchmarks")
from e2e import _prompt_ids, _time_engines, bench_config, identical_share
from side_by_side import prompt_set

import dspark.engine.llm_engine as le
from dspark import LLM
from dspark.spec import proposer as pr

orig_load = le.load_drafter
orig_init = pr.DSparkProposer.__init__


def bf16_load(path, dtype, device):
    return orig_load(path, dtype=torch.bfloat16, device=device)


def init(self, drafter, embedding, lm_head, *a, **k):
    if drafter.fc.weight.dtype == torch.bfloat16:
        lm_head = lm_head.to(torch.bfloat16)
    orig_init(self, drafter, embedding, lm_head, *a, **k)


pr.DSparkProposer.__init__ = init
cfg = bench_config("", "", "cpu", 1)
engines = {}
engines["plain"] = LLM(cfg.replace(spec_mode="off"))
engines["default"] = LLM(cfg)
le.load_drafter = bf16_load
engines["default-bf16-drafter"] = LLM(cfg)
le.load_drafter = orig_load
which = sys.argv[1] if len(sys.argv) > 1 else "bench"
prompts = prompt_set(which)
ids = _prompt_ids(engines["plain"], len(prompts), prompts)
res = _time_engines(engines, ids, 64, None, int(sys.argv[2]) if len(sys.argv) > 2 else 2, len(ids))
base = res["plain"][0]
for name, (rate, toks, stats) in res.items():
    print(
        f"{name:24s} {rate:7.1f} tok/s {rate / base:.3f}x plain  stats {stats}  "
        f"identical {identical_share(res['plain'][1], toks)}"
    )
