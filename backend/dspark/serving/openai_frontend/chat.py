"""Chat messages to prompt token ids, through the served model's own chat template."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dspark.serving.openai_frontend.errors import OpenAIError, invalid
from dspark.tokenizer import ChatTemplateError, Tokenizer


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer (tokenizer.json, tokenizer_config.json's chat template) of a model directory."""
    try:
        return Tokenizer.from_dir(Path(model_dir))
    except (OSError, ValueError) as exc:
        raise OpenAIError(500, f"cannot load the tokenizer of {model_dir}: {exc}") from None


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the messages rendered by the chat template, with the assistant's turn opened; an
    OpenAI error naming `messages` when the template refuses them."""
    try:
        return tokenizer.chat_prompt_ids(messages)
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
