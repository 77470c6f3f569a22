"""One request's responses from the dspark model, read off its own gRPC stream."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc

from dspark.serving.openai_frontend.errors import OpenAIError, from_model_message, unavailable


@dataclass
class Piece:
    """One streamed response of the dspark model: what it added to the completion."""

    text: str
    token_ids: list[int]
    final: bool
    finish_reason: str | None = None  # on the final piece: stop, length, abort or error
    num_input_tokens: int | None = None
    logprobs: list[dict[str, dict[str, Any]]] | None = None  # vLLM-shaped: one {id: entry} per token

    @classmethod
    def from_result(cls, result: Any) -> Piece:
        """From a tritonclient InferResult of the dspark model."""
        response = result.get_response()
        names = {output.name for output in response.outputs}
        final = response.parameters["triton_final_response"].bool_param
        reason = _string(result, "finish_reason") if "finish_reason" in names else ""
        logprobs = json.loads(_string(result, "logprobs") or "null") if "logprobs" in names else None
        return cls(
            text=_string(result, "text_output"),
            token_ids=[int(i) for i in result.as_numpy("output_ids").reshape(-1)],
            final=final,
            finish_reason=(reason or None) if final else None,
            num_input_tokens=(
                int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                if "num_input_tokens" in names
                else None
            ),
            logprobs=logprobs,
        )


class Generation:
    """An async iterator of a request's Pieces, ending after the final one; cancel() ends the request in
    the server (closing its gRPC stream, so that the model aborts it and frees its KV pages)."""

    def __init__(self, call: Any, param_names: dict[str, str]) -> None:
        self._call = call
        self._param_names = param_names
        self.done = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Piece:
        if self.done:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise unavailable("the model's stream ended before its final response") from None
        except grpc.aio.AioRpcError as exc:
            self.done = True
            raise _rpc_error(exc) from None
        if error is not None:
            self.done = True
            raise from_model_message(error.message(), self._param_names)
        piece = Piece.from_result(result)
        self.done = piece.final
        return piece

    def cancel(self) -> None:
        """Cancel the request in the server unless it has finished (idempotent)."""
        if not self.done:
            self.done = True
            self._call.cancel()


def _rpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """A gRPC call failure: Triton unreachable or restarting is a 503."""
    if exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ):
        return unavailable(f"Triton is unreachable: {exc.details()}")
    return OpenAIError(500, f"Triton: {exc.code().name}: {exc.details()}")


def _string(result: Any, name: str) -> str:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
