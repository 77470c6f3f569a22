"""OpenAI response bodies: whole completions and streamed chunks, for chat and for text completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

from dspark.serving.openai_frontend import logprobs
from dspark.serving.openai_frontend.generation import Piece
from dspark.serving.openai_frontend.protocol import GenerationRequest


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object, counted in tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Shape:
    """How one request's output is written, whole or as chunks (ChatShape, CompletionShape)."""

    id_prefix = ""
    whole_object = ""
    chunk_object = ""

    def __init__(self, request: GenerationRequest, echo_text: str = "") -> None:
        self.request = request
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echo_text = echo_text
        self.text_offset = len(echo_text)  # where the next token starts, for completions' text_offset

    def whole(self, text: str, pieces: list[Piece], finish_reason: str, counted: dict[str, int]) -> dict:
        """The non-streamed response body."""
        choice = {"index": 0, **self._content(text), "logprobs": self._logprobs(pieces)}
        return {
            **self._head(self.whole_object),
            "choices": [{**choice, "finish_reason": finish_reason}],
            "usage": counted,
        }

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token (the role for chat; the echoed prompt for completions)."""
        return []

    def chunk(self, text: str, piece: Piece | None, finish_reason: str | None) -> dict[str, Any]:
        """A streamed chunk carrying new text (and its tokens' log probabilities), or the finish reason."""
        choice = {"index": 0, **self._delta(text), "logprobs": self._logprobs([piece] if piece else [])}
        return self._streamed(
            {**self._head(self.chunk_object), "choices": [{**choice, "finish_reason": finish_reason}]}
        )

    def usage_chunk(self, counted: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": counted}

    def _streamed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """With include_usage every chunk but the last carries `usage: null`, as OpenAI sends it."""
        return {**chunk, "usage": None} if self.request.include_usage else chunk

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.request.model}

    def _content(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        raise NotImplementedError


class ChatShape(Shape):
    """`chat.completion` and `chat.completion.chunk`."""

    id_prefix = "chatcmpl"
    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self) -> list[dict[str, Any]]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._streamed({**self._head(self.chunk_object), "choices": [choice]})]

    def _content(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        top = self.request.logprobs
        if top is None:
            return None
        content = [
            item for p in pieces if p.logprobs for item in logprobs.chat_content(p.logprobs, p.token_ids, top)
        ]
        return {"content": content}


class CompletionShape(Shape):
    """`text_completion`, whole and streamed."""

    id_prefix = "cmpl"
    whole_object = "text_completion"
    chunk_object = "text_completion"

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk(self.echo_text, None, None)] if self.echo_text else []

    def _content(self, text: str) -> dict[str, Any]:
        return {"text": self.echo_text + text}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        top = self.request.logprobs
        if top is None:
            return None
        merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in pieces:
            if not piece.logprobs:
                continue
            part = logprobs.completion_logprobs(piece.logprobs, piece.token_ids, top, self.text_offset)
            self.text_offset += sum(len(token) for token in part["tokens"])
            for key, values in part.items():
                merged[key].extend(values)
        return merged
