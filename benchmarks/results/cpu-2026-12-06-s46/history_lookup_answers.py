"""Session 46: greedy raw-prompt answers (128 tokens) to 16 held-out prompts a domain and the 24 fresh
questions, written to /tmp/hist_data.json for history_lookup_potential.py."""

import json
import random
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from e2e import bench_config

from dspark import LLM, SamplingParams

prompts = []
rows = [
    json.loads(l)
    for l in open(
        str(__import__("pathlib").Path(__file__).resolve().parents[3] / "training/prompts_eval.jsonl")
    )
]
random.Random(7).shuffle(rows)
per = {}
for r in rows:
    if per.get(r["domain"], 0) < 16:
        per[r["domain"]] = per.get(r["domain"], 0) + 1
        prompts.append(r["prompt"])
prompts += [
    json.loads(l)["prompt"]
    for l in open(
        str(
            __import__("pathlib").Path(__file__).resolve().parents[1]
            / "cpu-2026-12-04-s33/fresh_everyday_24.jsonl"
        )
    )
]
llm = LLM(bench_config("", "", "cpu", 16, spec_mode="off"))
tok = llm.tokenizer
ids = [tok.encode(p) for p in prompts]
outs = llm.generate(params=SamplingParams(max_tokens=128), prompt_token_ids=ids)
data = [{"prompt": i, "answer": list(o.token_ids)} for i, o in zip(ids, outs, strict=False)]
json.dump(data, open("/tmp/hist_data.json", "w"))
print(len(data), sum(len(d["answer"]) for d in data))
