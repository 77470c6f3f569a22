"""Session 31, issue 19: the share of the target's greedy answer tokens (96 a prompt, plain, CPU fp32)
that the draft vocabulary's K most frequent tokens hold, on the bench's 8 everyday prompts and 8
held-out chat prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client"))
from bench import PROMPTS  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402

llm = LLM(EngineConfig(device="cpu", dtype="float32", spec_mode="off"))
vocab = load_file(str(ROOT / "drafters/SmolLM2-135M-Instruct-dspark/draft_vocab.safetensors"))
print({k: v.shape for k, v in vocab.items()})
order = next(iter(vocab.values())).tolist()


def cover(prompts, name):
    ids = [encode_prompt(llm.tokenizer, p) for p in prompts]
    outs = llm.generate(params=SamplingParams(max_tokens=96), prompt_token_ids=ids)
    toks = [t for o in outs for t in o.token_ids]
    for k in (4096, 8192, 16384):
        top = set(order[:k])
        print(name, k, f"{sum(t in top for t in toks) / len(toks):.3f}", len(toks))


cover([[{"role": "user", "content": p}] for p in PROMPTS], "bench")
held = []
for line in (ROOT / "training/prompts_eval.jsonl").read_text().splitlines():
    r = json.loads(line)
    if r["domain"] == "chat" and len(held) < 8:
        held.append(r.get("messages") or [{"role": "user", "content": r["prompt"]}])
cover(held, "heldout-chat")
