"""Self-generated prompts: user turns the target writes itself, for self-distillation data.

The committed prompt sets are built from text and code that Debian and PyPI packages ship: FAQs, man
pages, source files, generated math. Everyday requests ("Can you plan a birthday party...") are rare
there, and the drafter's tau is lowest on them (`benchmarks/RESULTS.md`, session 30: 36% of first
drafts right at word starts on `dspark-client bench`'s questions against 43-61% held out). An
instruction-tuned model has learned what users ask: given its chat template up to the start of a
user turn, and nothing else, it writes a user request when sampled (the idea of Magpie, Xu et al.
2024). Half the requests start from that prefix alone, the others from the prefix and an opening
phrase (`OPENERS`: kinds of request across chat, writing, code and math), so the kinds do not collapse
onto the few the model writes most. The turns are the target's own output (its licence applies, as it
does to the answers), cleaned (`clean_user_turn`) and de-duplicated, and written as a prompt set
(`write_prompt_set`): domain `self`, each prompt its own key.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.llm import LLM
    from dspark.tokenizer import Tokenizer

DOMAIN = "self"
SOURCE = "user turns written by the target under its chat template (self-generated)"
# A text no template changes, marking where the user's content goes.
_MARK = "\u2063USER-TURN\u2063"
# Opening phrases of requests; "" (the prefix alone) is drawn as often as all of them together.
OPENERS = (
    "How do I",
    "How can I",
    "What is",
    "What are",
    "What's the difference between",
    "Why",
    "Explain",
    "Can you explain",
    "Can you help me",
    "Can you",
    "Could you",
    "I need",
    "I'm",
    "I want to",
    "Give me",
    "Tell me",
    "Describe",
    "Summarize",
    "List",
    "Compare",
    "Suggest",
    "Recommend",
    "Create",
    "Write a short story",
    "Write a poem",
    "Write an email",
    "Write a blog post",
    "Write",
    "Rewrite",
    "Translate",
    "Edit",
    "Plan",
    "Brainstorm",
    "Help me write",
    "Write a Python function",
    "Write a JavaScript function",
    "Write a SQL query",
    "Write a bash script",
    "Write a C++ program",
    "Fix this code",
    "What does this code do",
    "How do I use",
    "Solve",
    "Calculate",
    "If",
    "A store",
    "Prove",
    "What would happen if",
    "Is it true that",
    "Should I",
)
_SPECIAL = re.compile(r"<\|[^|>]*\|>|<\s*/?\s*(?:s|pad|unk)\s*>")


def user_turn_prefix(tokenizer: Tokenizer) -> str:
    """The target's chat template rendered up to where a (first) user turn's text begins: its default
    system turn included, as every prompt the engine serves has it."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], add_generation_prompt=False
    )
    if _MARK not in rendered:
        raise ValueError("the chat template does not show a user turn's text")
    return rendered.split(_MARK)[0]


def clean_user_turn(text: str, max_chars: int = 1200) -> str | None:
    """The request `text` as a prompt, or None when it is not one: empty or too short (fewer than three
    words), too long, holding template markers, or with no letters."""
    text = text.strip()
    if not text or len(text) > max_chars or _SPECIAL.search(text):
        return None
    if len(text.split()) < 3 or not re.search(r"[A-Za-z]", text):
        return None
    return text


def generate_self_prompts(
    llm: LLM,
    count: int,
    seed: int,
    max_tokens: int = 128,
    batch: int = 1024,
    seconds: float = 0.0,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Up to `count` distinct user requests sampled from the target (temperature 1, top-p 0.95), in
    batches of `batch` until `count` are kept or `seconds` (0: no limit) have passed. Requests that
    run past `max_tokens` are dropped, as is any whose normalised text came before."""
    tokenizer = llm.tokenizer
    prefix = user_turn_prefix(tokenizer)
    rng = random.Random(seed)
    kept: list[str] = []
    seen: set[str] = set()
    started = time.monotonic()
    attempts = 0
    while len(kept) < count:
        if seconds and time.monotonic() - started > seconds:
            break
        openers = ["" if rng.random() < 0.5 else rng.choice(OPENERS) for _ in range(batch)]
        ids = [tokenizer.encode(prefix + opener, add_special_tokens=False) for opener in openers]
        params = [
            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=rng.getrandbits(31))
            for _ in openers
        ]
        outs = llm.generate(params=params, prompt_token_ids=ids)
        attempts += len(outs)
        for opener, out in zip(openers, outs, strict=True):
            if out.finish_reason != "stop":
                continue  # cut off by max_tokens: not a whole request
            text = clean_user_turn(opener + out.text)
            norm = " ".join(text.lower().split()) if text else ""
            if text and norm not in seen:
                seen.add(norm)
                kept.append(text)
                if len(kept) == count:
                    break
        log(f"self-prompts: {len(kept)} kept of {attempts} sampled, {time.monotonic() - started:.0f} s")
    return kept


def write_prompt_set(path: str | Path, texts: list[str], seed: int) -> None:
    """Write `texts` as a prompt set (JSON lines, `dspark.training.data.Prompt`'s fields): domain
    `self`, ids `self-<seed>-<n>`, each prompt its own key (held out whole, by itself)."""
    with open(path, "w", encoding="utf-8") as f:
        for n, text in enumerate(texts):
            pid = f"self-{seed}-{n}"
            row = {
                "id": pid,
                "domain": DOMAIN,
                "prompt": text,
                "source": SOURCE,
                "key": pid,
                "kind": "self/user-turn",
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
