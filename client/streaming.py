"""Streaming one completion from a dspark server: gRPC (tritonclient) or HTTP (/generate_stream SSE)."""

from __future__ import annotations

import itertools
import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

DEFAULT_MODEL = "dspark"
DEFAULT_GRPC_URL = "localhost:8001"
DEFAULT_HTTP_URL = "localhost:8000"
NOT_FINISHED = "None"  # finish_reason on a non-final response (str(None), as Triton's vLLM backend sends)
_request_ids = itertools.count()


class ServerError(RuntimeError):
    """The server answered the request with an error (its message names the bad field)."""


@dataclass
class Chunk:
    """One streamed response: the new text and token ids, and at the end why it finished."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "" until the last chunk
    spec_stats: dict | None
    final: bool


def next_request_id(prefix: str = "dspark-client") -> str:
    """A request id unique within this process."""
    return f"{prefix}-{next(_request_ids)}"


class GrpcSession:
    """One gRPC stream to the server, reused for successive requests (one at a time)."""

    def __init__(self, url: str = DEFAULT_GRPC_URL, model: str = DEFAULT_MODEL) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.model = model
        self._client = grpcclient.InferenceServerClient(url)
        self._results: queue.Queue = queue.Queue()
        self._in_flight = False
        self._client.start_stream(callback=lambda result, error: self._results.put((result, error)))

    def generate(
        self,
        prompt: str,
        params: dict,
        request_id: str | None = None,
        spec_stats: bool = False,
        timeout: float | None = None,
        chat: bool = False,
    ) -> Iterator[Chunk]:
        """Send one request and yield its chunks until the final one (ServerError when a response takes
        longer than `timeout` seconds, if given); with `chat`, the server renders the prompt as one user
        turn through the model's chat template."""
        inputs = [
            self._input("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            self._input("stream", np.array([True]), "BOOL"),
            self._input(
                "sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"
            ),
            self._input("return_finish_reason", np.array([True]), "BOOL"),
            self._input("return_spec_stats", np.array([spec_stats]), "BOOL"),
        ]
        if chat:  # only then: a model without this input (Triton's vLLM backend's) takes raw requests
            inputs.append(self._input("apply_chat_template", np.array([True]), "BOOL"))
        self._client.async_stream_infer(self.model, inputs, request_id=request_id or next_request_id())
        self._in_flight = True
        while True:
            try:
                result, error = self._results.get(timeout=timeout)
            except queue.Empty:
                raise ServerError(f"no response in {timeout} s") from None
            if error is not None:
                self._in_flight = False
                raise ServerError(str(error.message() if hasattr(error, "message") else error))
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            reason = _finish_reason(_first_string(result.as_numpy("finish_reason")))
            stats = result.as_numpy("spec_stats")
            yield Chunk(
                text=_first_string(result.as_numpy("text_output")),
                token_ids=[int(t) for t in result.as_numpy("output_ids").reshape(-1)],
                finish_reason=reason,
                spec_stats=json.loads(_first_string(stats)) if stats is not None else None,
                final=final,
            )
            if final:
                self._in_flight = False
                return

    def close(self) -> None:
        """End the stream and the connection, cancelling a request still running.

        A finished stream is closed without cancelling: a cancellation that races the last
        response can leave request state behind in the gRPC frontend of older Triton releases.
        """
        self._client.stop_stream(cancel_requests=self._in_flight)
        self._client.close()

    def _input(self, name: str, value: np.ndarray, datatype: str):
        tensor = self._grpc.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        return tensor


def stream_http(
    prompt: str,
    params: dict,
    url: str = DEFAULT_HTTP_URL,
    model: str = DEFAULT_MODEL,
    request_id: str | None = None,
    spec_stats: bool = False,
    timeout: float = 600.0,
    chat: bool = False,
) -> Iterator[Chunk]:
    """POST /v2/models/{model}/generate_stream and yield the SSE events as chunks (with `chat`, the
    prompt is one user turn through the model's chat template).

    Sampling parameters travel as the `sampling_parameters` JSON string (the generate endpoint
    takes only scalar request parameters, and `stop` is a list).
    """
    body = {
        "id": request_id or next_request_id(),
        "text_input": prompt,
        "stream": True,
        "sampling_parameters": json.dumps(params),
        "return_finish_reason": True,
        "return_spec_stats": spec_stats,
    }
    if chat:
        body["apply_chat_template"] = True
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ServerError(_error_text(exc.read())) from None
    with response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise ServerError(event["error"])
            reason = _finish_reason(event.get("finish_reason", ""))
            ids = event.get("output_ids", [])
            yield Chunk(
                text=event.get("text_output", ""),
                token_ids=ids if isinstance(ids, list) else [ids],
                finish_reason=reason,
                spec_stats=json.loads(event["spec_stats"]) if "spec_stats" in event else None,
                final=bool(reason),
            )


def cancel_http(request_id: str, url: str = DEFAULT_HTTP_URL, model: str = DEFAULT_MODEL) -> None:
    """Cancel a request in flight by its id (the dspark model's `cancel_request_id` input)."""
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate",
        data=json.dumps({"cancel_request_id": request_id}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=30).close()
    except urllib.error.HTTPError as exc:
        raise ServerError(_error_text(exc.read())) from None


def _finish_reason(sent: str) -> str:
    """The finish reason a response carries, "" before the last one."""
    return "" if sent == NOT_FINISHED else sent


def _first_string(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _error_text(body: bytes) -> str:
    """The message of an error body: JSON, or one SSE event holding JSON."""
    text = body.decode(errors="replace").strip()
    try:
        return json.loads(text.removeprefix("data:"))["error"]
    except (ValueError, KeyError):
        return text
