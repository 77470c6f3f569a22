"""The served model behind Triton's gRPC endpoint: its configuration, readiness, and a request's stream.

One gRPC channel serves every request; each request gets its own bidirectional stream, so closing
that stream cancels that request alone. The channel reconnects on its own after Triton restarts
(backoff capped at MAX_RECONNECT_BACKOFF_MS); while Triton is down, calls fail at once and the
frontend answers 503.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from dspark.config import EngineConfig
from dspark.serving.openai_frontend.errors import from_model_message, unavailable
from dspark.serving.openai_frontend.generation import Generation

MAX_MESSAGE_BYTES = 2**31 - 1
MAX_RECONNECT_BACKOFF_MS = 1000  # gRPC's default grows to 120 s: a restarted server would wait that long
INFO_TTL_S = 2.0  # how long the model's configuration is reused before it is read again
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to know of the served model."""

    inputs: frozenset[str]
    model_dir: str  # its Hugging Face directory (tokenizer and chat template)

    @property
    def has_logprobs(self) -> bool:
        """Whether the model takes the vLLM backend's `return_logprobs` input."""
        return "return_logprobs" in self.inputs


@dataclass(frozen=True)
class TritonRequest:
    """What one generation sends the dspark model."""

    prompt: str | list[int]  # text_input, or input_ids
    sampling: dict[str, Any]
    logprobs: int | None
    request_id: str


class TritonModel:
    """The dspark model (or another of its interface) served by Triton at `url`."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self._client = grpcclient_aio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
        self._info: ModelInfo | None = None
        self._info_at = 0.0

    async def close(self) -> None:
        """Close the channel."""
        await self._client.close()

    async def ready(self) -> bool:
        """Whether Triton answers and the model is ready."""
        try:
            return bool(await self._client.is_model_ready(self.name, client_timeout=5))
        except InferenceServerException:
            return False

    async def info(self) -> ModelInfo:
        """The model's inputs and directory, read from Triton (reused for INFO_TTL_S)."""
        if self._info is not None and time.monotonic() - self._info_at < INFO_TTL_S:
            return self._info
        try:
            config = (await self._client.get_model_config(self.name, as_json=True, client_timeout=5))[
                "config"
            ]
        except InferenceServerException as exc:
            raise unavailable(f"model {self.name} is not available: {exc.message()}") from None
        engine = EngineConfig.from_parameters(_parameters(config))
        self._info = ModelInfo(frozenset(t["name"] for t in config.get("input", [])), str(engine.model_path))
        self._info_at = time.monotonic()
        return self._info

    async def generate(self, request: TritonRequest, param_names: dict[str, str]) -> Generation:
        """Start a request on its own stream; its Pieces follow from the returned Generation."""
        message = {
            "model_name": self.name,
            "inputs": _inputs(request),
            "request_id": request.request_id,
        }
        try:
            call = self._client.stream_infer(_once(message))
        except InferenceServerException as exc:
            raise from_model_message(exc.message(), param_names) from None
        except grpc.aio.AioRpcError as exc:
            raise unavailable(f"Triton is unreachable: {exc.details()}") from None
        return Generation(call, param_names)


def _parameters(config: dict[str, Any]) -> dict[str, str]:
    """The model's `parameters` as strings (gRPC's JSON leaves an empty `string_value` out)."""
    return {key: entry.get("string_value", "") for key, entry in config.get("parameters", {}).items()}


async def _once(message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The stream's only request; the stream half-closes after it, and ends after the final response."""
    yield message


def _inputs(request: TritonRequest) -> list:
    """The model's input tensors for one request (always streamed, prompt excluded from the output)."""
    sampling = dict(request.sampling)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    if isinstance(request.prompt, str):
        tensors["text_input"] = (np.array([request.prompt.encode()], dtype=np.object_), "BYTES")
    else:
        tensors["input_ids"] = (np.array(request.prompt, dtype=np.int64), "INT64")
    flags = ["stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens"]
    if request.logprobs is not None:
        flags.append("return_logprobs")
        sampling["logprobs"] = request.logprobs
    for flag in flags:
        tensors[flag] = (np.array([True]), "BOOL")
    tensors["sampling_parameters"] = (np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES")
    inputs = []
    for name, (array, datatype) in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs
