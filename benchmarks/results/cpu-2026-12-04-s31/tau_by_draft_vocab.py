"""Session 31, issue 19: tau of the shipped drafter (static, blocks of 3, greedy, 96 tokens, CPU fp32) on the
bench's 8 everyday prompts (chat template, and raw) and 8 held-out chat prompts, drafting from the
8192 most frequent tokens (the default) or from every token (draft_vocab_size -1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client"))
from bench import PROMPTS  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.training.data import encode_prompt  # noqa: E402

held = []
for line in (ROOT / "training/prompts_eval.jsonl").read_text().splitlines():
    r = json.loads(line)
    if r["domain"] == "chat" and len(held) < 8:
        held.append(r.get("messages") or [{"role": "user", "content": r["prompt"]}])
sets = {
    "bench-chat": [[{"role": "user", "content": p}] for p in PROMPTS],
    "bench-raw": None,
    "heldout-chat": held,
}
for k in (8192, -1):
    llm = LLM(
        EngineConfig(
            device="cpu", dtype="float32", spec_mode="static", adaptive_speculation=False, draft_vocab_size=k
        )
    )
    for name, prompts in sets.items():
        if prompts is None:
            ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        else:
            ids = [encode_prompt(llm.tokenizer, p) for p in prompts]
        outs = llm.generate(params=SamplingParams(max_tokens=96), prompt_token_ids=ids)
        steps = sum(o.spec_stats.steps for o in outs)
        toks = sum(len(o.token_ids) for o in outs)
        acc = sum(o.spec_stats.accepted_tokens for o in outs)
        print(f"K={k} {name}: tau {(acc + steps) / steps:.3f} ({toks} tokens, {steps} steps)", flush=True)
    llm.close()
