"""Errors in OpenAI's JSON shape, and the kind of each error the dspark model or Triton reports."""

from __future__ import annotations

import dataclasses
from typing import Any

from dspark.sampling_params import SamplingParams
from dspark.serving.triton_config import INPUTS

# A client error from the dspark model starts with the field it names: an input tensor, a sampling
# parameter ("sampling_parameters.top_p") or a sampling field checked against the model.
CLIENT_ERROR_FIELDS = (
    frozenset(tensor["name"] for tensor in INPUTS)
    | {"sampling_parameters", "parameters"}
    | {f.name for f in dataclasses.fields(SamplingParams)}
)
PROMPT_FIELDS = ("text_input", "input_ids")  # what the frontend filled from `prompt` / `messages`
# Messages of a model or server that cannot serve now (the dspark model's and Triton's own).
UNAVAILABLE_MARKERS = (
    "engine is not running",
    "model is shutting down",
    "is not healthy",
    "is not ready",
    "unknown model",
    "is not found",
    "no available versions",
    "unavailable",
    "failed to connect",
    "connection refused",
    "socket closed",
)


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        """OpenAI's error type for this status."""
        if self.status == 404:
            return "not_found_error"
        if self.status < 500:
            return "invalid_request_error"
        return "service_unavailable_error" if self.status == 503 else "server_error"

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> OpenAIError:
    """A 400 naming the request parameter at fault (the message starts with it too)."""
    return OpenAIError(400, f"{param}: {message}", param=param)


def unavailable(message: str) -> OpenAIError:
    """A 503: the model cannot serve now (not ready, restarting, or Triton unreachable)."""
    return OpenAIError(503, message, code="model_not_ready")


def from_model_message(message: str, param_names: dict[str, str]) -> OpenAIError:
    """The OpenAI error for an error message of the dspark model or of Triton.

    A message naming a request field becomes a 400 naming the client's parameter (`param_names` maps
    the model's field, such as `max_tokens` or `input_ids`, to what the client sent: `max_completion_tokens`,
    `messages`); unavailability becomes 503; anything else 500.
    """
    field, _, rest = message.partition(":")
    field = field.strip()
    base = field.split(".", 1)[0]
    if " " not in field and base in CLIENT_ERROR_FIELDS:
        model_field = (
            field.split(".", 1)[1]
            if base in ("sampling_parameters", "parameters") and "." in field
            else field
        )
        param = param_names.get(model_field, model_field)
        return invalid(param, rest.strip())
    lowered = message.lower()
    if any(marker in lowered for marker in UNAVAILABLE_MARKERS):
        return unavailable(message)
    return OpenAIError(500, message)
