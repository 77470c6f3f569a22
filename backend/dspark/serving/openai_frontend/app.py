"""The ASGI app: OpenAI's `/v1/models`, `/v1/completions` and `/v1/chat/completions`, plus `/health`.

Each handler reads the body (protocol), checks the model, renders the prompt (chat template for
chat), starts the request on Triton (triton) and waits for its first response before answering, so
that a rejected request gets its HTTP status (400 naming the parameter, 503 when the model cannot
serve) rather than an error inside a stream; then it streams (SSE) or collects (streaming).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dspark.serving.openai_frontend.chat import chat_prompt_ids, load_tokenizer
from dspark.serving.openai_frontend.errors import OpenAIError, invalid, unavailable
from dspark.serving.openai_frontend.generation import Generation, Piece
from dspark.serving.openai_frontend.protocol import GenerationRequest, parse_chat, parse_completion
from dspark.serving.openai_frontend.responses import ChatShape, CompletionShape, Shape
from dspark.serving.openai_frontend.streaming import EventStream, collect
from dspark.serving.openai_frontend.triton import ModelInfo, TritonModel, TritonRequest

OWNED_BY = "dspark"
T = TypeVar("T")


def create_app(grpc_url: str, model_name: str) -> Starlette:
    """The frontend for `model_name` served by the Triton server at `grpc_url` (host:port)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.model = TritonModel(grpc_url, model_name)  # the gRPC channel binds to this event loop
        app.state.created = int(time.time())
        yield
        await app.state.model.close()

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{name:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {OpenAIError: openai_error, HTTPException: http_error, Exception: internal_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def list_models(request: Request) -> Response:
    """`GET /v1/models`: the served model, once it is ready (503 before)."""
    await _require_ready(request)
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def get_model(request: Request) -> Response:
    """`GET /v1/models/{name}`."""
    _check_model_name(request, request.path_params["name"])
    await _require_ready(request)
    return JSONResponse(_model_card(request))


async def health(request: Request) -> Response:
    """200 while the model is ready, else 503 (for load balancers and probes)."""
    await _require_ready(request)
    return JSONResponse({})


async def completions(request: Request) -> Response:
    """`POST /v1/completions`."""
    return await _generate(request, parse_completion(await _body(request)))


async def chat_completions(request: Request) -> Response:
    """`POST /v1/chat/completions`."""
    return await _generate(request, parse_chat(await _body(request)))


async def _generate(request: Request, wanted: GenerationRequest) -> Response:
    model: TritonModel = request.app.state.model
    _check_model_name(request, wanted.model)
    info = await model.info()
    if wanted.logprobs is not None and not info.has_logprobs:
        raise invalid(_logprobs_param(wanted), "log probabilities are not available from this model yet")
    prompt, echo_text = _prompt(wanted, info)
    shape: Shape = (ChatShape if wanted.chat else CompletionShape)(wanted, echo_text)
    triton_request = TritonRequest(prompt, wanted.sampling, wanted.logprobs, shape.id)
    generation = await model.generate(triton_request, _param_names(wanted))
    first: Piece = await _unless_disconnected(request, generation, generation.__anext__())
    if wanted.stream:
        return EventStream(generation, first, shape)
    return JSONResponse(await _unless_disconnected(request, generation, collect(generation, first, shape)))


def _prompt(wanted: GenerationRequest, info: ModelInfo) -> tuple[str | list[int], str]:
    """What the model is sent (text, or token ids), and the text a completion echoes."""
    if wanted.chat:
        return chat_prompt_ids(load_tokenizer(info.model_dir), wanted.prompt), ""
    if not wanted.echo:
        return wanted.prompt, ""
    if isinstance(wanted.prompt, str):
        return wanted.prompt, wanted.prompt
    return wanted.prompt, load_tokenizer(info.model_dir).decode(wanted.prompt)


def _param_names(wanted: GenerationRequest) -> dict[str, str]:
    """The model's field names -> what the client sent, for errors that name a field."""
    return {
        "text_input": wanted.prompt_param,
        "input_ids": wanted.prompt_param,
        "return_logprobs": "logprobs",
        "logprobs": _logprobs_param(wanted),
        **wanted.param_names,
    }


def _logprobs_param(wanted: GenerationRequest) -> str:
    """The client's parameter that sets how many alternatives per token are returned."""
    return "top_logprobs" if wanted.chat and wanted.logprobs else "logprobs"


async def _unless_disconnected(request: Request, generation: Generation, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel the generation in the server."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():  # the client went away (or this handler was cancelled)
            generation.cancel()
            working.cancel()
    if working.cancelled():
        raise ClientDisconnect()
    return working.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid("body", f"invalid JSON: {exc}") from None


def _check_model_name(request: Request, name: str) -> None:
    served = request.app.state.model.name
    if name != served:
        raise OpenAIError(
            404,
            f"The model '{name}' does not exist (this server serves '{served}')",
            "model",
            "model_not_found",
        )


async def _require_ready(request: Request) -> None:
    model: TritonModel = request.app.state.model
    if not await model.ready():
        raise unavailable(f"model {model.name} is not ready (or Triton at {model.url} is unreachable)")


def _model_card(request: Request) -> dict[str, Any]:
    name = request.app.state.model.name
    return {"id": name, "object": "model", "created": request.app.state.created, "owned_by": OWNED_BY}


async def openai_error(request: Request, exc: Exception) -> Response:
    """Every error in OpenAI's shape, with its status."""
    assert isinstance(exc, OpenAIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug of the frontend: a 500 in OpenAI's shape (the traceback goes to the log)."""
    return JSONResponse(
        OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500
    )
