"""`dspark-client bench`'s prompts: everyday questions, one user turn each (a module of their own,
without the client's dependencies, so that scripts on a bare machine can read them too), or the user's
own (`read_prompts`)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = [
    "Explain how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "What are the three primary colors?",
    "Describe the water cycle in simple terms.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
]


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: JSON lines with a "prompt" field each (`.jsonl`), else one per line; blank
    lines skipped. ValueError names the line that has no prompt."""
    path = Path(path)
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                prompt = json.loads(line).get("prompt")
            except (json.JSONDecodeError, AttributeError):
                prompt = None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f'{path}:{number}: expected a JSON object with a "prompt" string')
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
