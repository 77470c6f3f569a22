"""Self-generated prompts: user turns the target writes itself, for self-distillation data.

The committed prompt sets are built from text and code that Debian and PyPI packages ship: FAQs, man
pages, source files, generated math. Everyday requests ("Can you plan a birthday party...") are rare
there, and the drafter's tau is lowest on them (`benchmarks/RESULTS.md`, session 30: 36% of first
drafts right at word starts on `dspark-client bench`'s questions against 43-61% held out). An
instruction-tuned model has learned what users ask: given its chat template up to the start of a
user turn, and nothing else, it writes a user request when sampled (the idea of Magpie, Xu et al.
2024). Half the requests start from that prefix alone, the others from the prefix and an opening
phrase (`OPENERS`: kinds of request across chat, writing, code and math), so the kinds do not collapse
onto the few the model writes most. A share of them continue into a second turn: the target's own
answer, then a follow-up request sampled after it the same way (multi-turn chat, as users have it).
The turns are the target's own output (its licence applies, as it does to the answers), cleaned
(`clean_user_turn`) and de-duplicated, and written as a prompt set (`write_prompt_set`): domain `self`,
each prompt its own key.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.sampling_params import SamplingParams
from dspark.training.data import encode_prompt

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
# Opening phrases of a follow-up request, after the target's answer.
FOLLOW_UP_OPENERS = (
    "Can you",
    "Could you",
    "What about",
    "How about",
    "Thanks!",
    "Thank you.",
    "That's helpful.",
    "Now",
    "Why",
    "How",
    "What if",
    "Can you explain",
    "Can you give me an example",
    "Make it",
    "Please",
    "I",
)
Conversation = list[dict[str, str]]
# The most tokens of the target's answer before a follow-up (a longer one is not followed up).
ANSWER_TOKENS = 256
_SPECIAL = re.compile(r"<\|[^|>]*\|>|<\s*/?\s*(?:s|pad|unk)\s*>")


def user_turn_prefix(tokenizer: Tokenizer, history: Sequence[dict[str, str]] = ()) -> str:
    """The target's chat template rendered up to where a user turn's text begins: after `history`
    (earlier user and assistant turns; none: the first turn), its default system turn included, as
    every prompt the engine serves has it."""
    messages = [*history, {"role": "user", "content": _MARK}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
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
    follow_up_share: float = 0.0,
    answer_tokens: int = ANSWER_TOKENS,
    log: Callable[[str], None] = print,
) -> list[Conversation]:
    """Up to `count` conversations the target wrote as its users, each ending with a user turn.

    First, distinct requests sampled from the target (temperature 1, top-p 0.95), in batches of
    `batch` until `count` are kept or `seconds` (0: no limit; less the follow-ups' share of it) have
    passed; requests that run past `max_tokens` are dropped, as is any whose normalised text came
    before. Then `follow_up_share` of them become two-turn conversations: the target's greedy answer
    (whole, within `answer_tokens`) and a follow-up request sampled after it the same way."""
    tokenizer = llm.tokenizer
    rng = random.Random(seed)
    started = time.monotonic()
    first_seconds = seconds * (1.0 - follow_up_share) if seconds else 0.0
    first = _first_turns(llm, count, rng, max_tokens, batch, first_seconds, log)
    conversations: list[Conversation] = [[{"role": "user", "content": text}] for text in first]
    chosen = sorted(rng.sample(range(len(first)), round(follow_up_share * len(first))))
    followed = 0
    greedy = SamplingParams(max_tokens=answer_tokens)
    for at in range(0, len(chosen), batch):
        if seconds and time.monotonic() - started > seconds:
            break
        rows = chosen[at : at + batch]
        answers = llm.generate(
            params=greedy, prompt_token_ids=[encode_prompt(tokenizer, conversations[r]) for r in rows]
        )
        # Whole answers only: a follow-up to a cut-off answer is not a conversation users have.
        whole = [
            (r, a.text.strip())
            for r, a in zip(rows, answers, strict=True)
            if a.finish_reason == "stop" and a.text.strip()
        ]
        histories = [[*conversations[r], {"role": "assistant", "content": text}] for r, text in whole]
        openers = [_opener(rng, FOLLOW_UP_OPENERS) for _ in histories]
        turns = _sample_turns(
            llm, [user_turn_prefix(tokenizer, h) for h in histories], openers, rng, max_tokens
        )
        for (r, _), history, turn in zip(whole, histories, turns, strict=True):
            if turn is not None:
                conversations[r] = [*history, {"role": "user", "content": turn}]
                followed += 1
        seconds_so_far = time.monotonic() - started
        log(f"self-prompts: {followed} follow-ups of {at + len(rows)} tried, {seconds_so_far:.0f} s")
    return conversations


def _opener(rng: random.Random, openers: Sequence[str]) -> str:
    """No opening phrase half the time, else one of `openers`."""
    return "" if rng.random() < 0.5 else rng.choice(openers)


def _sample_turns(
    llm: LLM, prefixes: list[str], openers: list[str], rng: random.Random, max_tokens: int
) -> list[str | None]:
    """One user turn sampled after each prefix and its opening phrase: the whole turn, cleaned (None:
    cut off by `max_tokens`, or not a request)."""
    if not prefixes:
        return []
    tokenizer = llm.tokenizer
    ids = [tokenizer.encode(p + o, add_special_tokens=False) for p, o in zip(prefixes, openers, strict=True)]
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=rng.getrandbits(31))
        for _ in ids
    ]
    outs = llm.generate(params=params, prompt_token_ids=ids)
    return [
        clean_user_turn(o + out.text) if out.finish_reason == "stop" else None
        for o, out in zip(openers, outs, strict=True)
    ]


def _first_turns(
    llm: LLM,
    count: int,
    rng: random.Random,
    max_tokens: int,
    batch: int,
    seconds: float,
    log: Callable[[str], None],
) -> list[str]:
    """Up to `count` distinct first requests (`generate_self_prompts`)."""
    prefix = user_turn_prefix(llm.tokenizer)
    kept: list[str] = []
    seen: set[str] = set()
    started = time.monotonic()
    attempts = 0
    while len(kept) < count:
        if seconds and time.monotonic() - started > seconds:
            break
        openers = [_opener(rng, OPENERS) for _ in range(batch)]
        turns = _sample_turns(llm, [prefix] * batch, openers, rng, max_tokens)
        attempts += batch
        for text in turns:
            norm = " ".join(text.lower().split()) if text else ""
            if text and norm not in seen:
                seen.add(norm)
                kept.append(text)
                if len(kept) == count:
                    break
        log(f"self-prompts: {len(kept)} kept of {attempts} sampled, {time.monotonic() - started:.0f} s")
    return kept


def write_prompt_set(path: str | Path, conversations: list[Conversation], seed: int) -> None:
    """Write `conversations` as a prompt set (JSON lines, `dspark.training.data.Prompt`'s fields):
    domain `self`, ids `self-<seed>-<n>`, each prompt its own key (held out whole, by itself); `prompt`
    is the last user turn, and a conversation of several turns is in `messages` too."""
    with open(path, "w", encoding="utf-8") as f:
        for n, messages in enumerate(conversations):
            pid = f"self-{seed}-{n}"
            row = {
                "id": pid,
                "domain": DOMAIN,
                "prompt": messages[-1]["content"],
                "source": SOURCE,
                "key": pid,
                "kind": "self/follow-up" if len(messages) > 1 else "self/user-turn",
            }
            if len(messages) > 1:
                row["messages"] = messages
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
