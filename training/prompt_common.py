"""What every prompt source shares: the record, the held-out rule and the pools of instruction wording."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass

# Share of a source's units (documents, modules, files, words, generator modules) held out for evaluation.
EVAL_PERCENT = 8


@dataclass
class Prompt:
    """One prompt with its provenance.

    `key` is the unit the split holds out (a document, a module, a file, a word, a generator module): all
    prompts of one key fall on one side. `messages`, when set, is a whole conversation (user and
    assistant turns, the last a user turn) and `prompt` its last user turn.
    """

    id: str
    domain: str
    prompt: str
    source: str
    key: str
    kind: str
    messages: list[dict[str, str]] | None = None

    def record(self) -> dict:
        """The JSON-lines record (no `messages` key for a one-turn prompt)."""
        record = asdict(self)
        if self.messages is None:
            del record["messages"]
        return record

    def text(self) -> str:
        """The whole conversation as one string: what "the same prompt" means across the split."""
        if self.messages is None:
            return self.prompt
        return "\n\x1e".join(f"{m['role']}: {m['content']}" for m in self.messages)


def held_out(key: str, percent: int = EVAL_PERCENT) -> bool:
    """Whether everything derived from `key` belongs to the evaluation set."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100 < percent


def conversation(*turns: str) -> list[dict[str, str]]:
    """Messages alternating user, assistant, user, ... (an odd number of turns: a user turn last)."""
    assert len(turns) % 2 == 1
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def squash(text: str) -> str:
    """Whitespace runs to one space."""
    return re.sub(r"\s+", " ", text).strip()


def first_sentences(text: str, limit: int) -> str:
    """The leading sentences of `text` that fit in `limit` characters (at least the first)."""
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", squash(text))
    out = sentences[0]
    for s in sentences[1:]:
        if len(out) + 1 + len(s) > limit:
            break
        out += " " + s
    return out


def head_of(text: str, limit: int) -> str:
    """`text` cut at a paragraph (else sentence) boundary to at most about `limit` characters."""
    if len(text) <= limit:
        return text
    paras = text.split("\n\n")
    out = paras[0]
    for p in paras[1:]:
        if len(out) + 2 + len(p) > limit:
            break
        out += "\n\n" + p
    return out if len(out) <= limit else first_sentences(out, limit)


# Ways to ask for an answer of a given length or style; appended to many instructions.
ANSWER_STYLES = (
    "",
    "",
    "",
    " Answer briefly.",
    " Keep it short.",
    " Please explain in detail.",
    " Give a thorough answer with examples.",
    " One or two sentences, please.",
    " Explain it like I'm new to this.",
    " Use a bulleted list.",
    " Be concise but complete.",
    " Answer in under 100 words.",
    " Walk me through it step by step.",
)

# Follow-ups after an assistant's answer, for multi-turn prompts.
FOLLOW_UPS = (
    "Can you give me a concrete example?",
    "Could you say that more briefly?",
    "Thanks. Why is that the case?",
    "What are common mistakes people make with this?",
    "Can you summarize that in one sentence?",
    "I don't quite follow. Could you explain it more simply?",
    "Is there an alternative approach?",
    "Great, and what should I watch out for?",
    "Can you put that as a numbered list of steps?",
    "How would you explain this to a beginner?",
    "What's the most important point there?",
    "OK. Can you expand on the last part?",
    "Does this apply in every case, or are there exceptions?",
    "Could you rewrite your answer in a more formal tone?",
    "Interesting! Where can I learn more about this?",
)


def styled(rng: random.Random, text: str) -> str:
    """`text` with a random answer-style request appended (often none)."""
    return text + rng.choice(ANSWER_STYLES)


# Instructions on a passage of prose: {text} is the passage, {n} a number of words.
PASSAGE_TASKS = (
    "Summarize the following paragraph in two sentences:\n\n{text}",
    "Summarize this in about {n} words:\n\n{text}",
    "Give me a one-line summary of this text.\n\n{text}",
    "Rewrite the following text in plain language for a beginner:\n\n{text}",
    "Rewrite this passage in a formal, academic register:\n\n{text}",
    "Rewrite this so it sounds casual and friendly:\n\n{text}",
    "List the key points of this passage as bullets.\n\n{text}",
    "Turn the following notes into a short, friendly paragraph for a newsletter:\n\n{text}",
    "Write a good title for this paragraph and explain your choice.\n\n{text}",
    "What are three questions a reader might ask after reading this?\n\n---\n{text}\n---",
    "Explain this passage to a twelve-year-old.\n\n{text}",
    "Shorten this to at most {n} words without losing the meaning:\n\n{text}",
    "Here is a paragraph:\n\n{text}\n\nWhat is its main idea?",
    "Proofread and improve the style of this text:\n\n{text}",
    "Convert this paragraph into a short FAQ with two questions and answers.\n\n{text}",
    "{text}\n\nTL;DR?",
    "Read this and tell me whether it is written for experts or beginners, and why:\n\n{text}",
)

# Asking for a continuation: {text} is the opening.
CONTINUE_TASKS = (
    "Continue this passage:\n\n{text}",
    "Continue the following text for another paragraph, in the same style:\n\n{text}",
    "Here is the beginning of a text. Write what comes next.\n\n{text}",
    "Finish this paragraph:\n\n{text}",
    "{text}",
    'Keep going from where this leaves off:\n\n"{text}"',
    "Write the next few sentences.\n\n{text}",
)


def passage_prompt(rng: random.Random, text: str) -> tuple[str, str]:
    """(kind, prompt) of a random instruction about a prose passage: a task on it, or its continuation."""
    if rng.random() < 0.35:
        words = text.split()
        cut = max(8, int(len(words) * rng.uniform(0.3, 0.6)))
        return "continue", rng.choice(CONTINUE_TASKS).format(text=" ".join(words[:cut]))
    return "instruct", rng.choice(PASSAGE_TASKS).format(text=text, n=rng.choice((15, 20, 30, 50, 75)))
