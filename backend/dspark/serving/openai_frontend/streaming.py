"""A Generation turned into an OpenAI answer: server-sent events, or one JSON body.

The SSE response cancels its Generation in the server when it ends before the final piece (the client
went away: Starlette stops the response when it sees the disconnect).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dspark.serving.openai_frontend.errors import OpenAIError, unavailable
from dspark.serving.openai_frontend.generation import Generation, Piece
from dspark.serving.openai_frontend.responses import Shape, usage

FINISH_REASONS = {"stop": "stop", "length": "length"}
DONE = "data: [DONE]\n\n"


def finish_reason(piece: Piece) -> str:
    """OpenAI's finish_reason for the final piece; an aborted request (server shutting down) is a 503."""
    if piece.finish_reason == "abort":
        raise unavailable("the request was aborted: the server is shutting down")
    return FINISH_REASONS.get(piece.finish_reason or "stop", "stop")


def event(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """text/event-stream of a Generation; cancels it in the server if the stream ends early."""

    def __init__(self, generation: Generation, first: Piece, shape: Shape) -> None:
        self.generation = generation
        super().__init__(_events(generation, first, shape), media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()  # a no-op once the final piece came
            await self.body_iterator.aclose()


async def _events(generation: Generation, first: Piece, shape: Shape) -> AsyncIterator[str]:
    """The SSE body: opening chunks, a chunk per piece, the finish reason, usage if asked, [DONE]."""
    for chunk in shape.opening():
        yield event(chunk)
    piece, prompt_tokens, completion_tokens = first, first.num_input_tokens or 0, 0
    try:
        while True:
            completion_tokens += len(piece.token_ids)
            if piece.text or piece.logprobs:
                yield event(shape.chunk(piece.text, piece, None))
            if piece.final:
                break
            piece = await generation.__anext__()
        yield event(shape.chunk("", None, finish_reason(piece)))
        if shape.request.include_usage:
            yield event(shape.usage_chunk(usage(prompt_tokens, completion_tokens)))
    except OpenAIError as exc:
        yield event(exc.body())
    yield DONE


async def collect(generation: Generation, first: Piece, shape: Shape) -> dict[str, Any]:
    """The whole response body, once the final piece has come."""
    pieces = [first]
    while not pieces[-1].final:
        pieces.append(await generation.__anext__())
    text = "".join(piece.text for piece in pieces)
    counted = usage(first.num_input_tokens or 0, sum(len(piece.token_ids) for piece in pieces))
    return shape.whole(text, pieces, finish_reason(pieces[-1]), counted)
