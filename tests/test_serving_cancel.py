"""Cancellation: a gRPC stream that goes away, and an HTTP cancel by request id, free their KV pages."""

from __future__ import annotations

import json
import threading
import time

import pytest
from server_fixtures import GrpcStream, wait_for

pytestmark = pytest.mark.server

LONG_PROMPT = "Tell me a long story about a dragon who learns to read. " * 12
LONG = {"max_tokens": 400, "ignore_eos": True}


def pages_used(server) -> float:
    return server.metric("dspark_kv_pages_used", model="dspark")


def cancel_in_flight(server, request_id: str, request: threading.Thread) -> tuple[int, str]:
    """Post a cancel of `request_id` until the server finds it in flight (while `request`, the thread
    waiting on it, runs): the server's answer. A gauge polled first (pages in use) can lag a whole
    request on a GPU, where a 380-token request takes a fraction of a second."""
    while True:
        status, body = server.post("/v2/models/dspark/generate", {"cancel_request_id": request_id})
        if status == 200 or not request.is_alive():
            return status, body
        time.sleep(0.002)


def test_cancelled_grpc_stream_frees_its_kv_pages_at_the_next_step(triton_server):
    assert wait_for(lambda: pages_used(triton_server) == 0)
    grpc = GrpcStream(triton_server).send(text_input=LONG_PROMPT, stream=True, sampling_parameters=LONG)
    for _ in range(2):
        assert not isinstance(grpc.next(), str)
    assert wait_for(lambda: pages_used(triton_server) >= 8), (
        "a ~130-token prompt holds several 16-token pages"
    )
    grpc.cancel()
    assert wait_for(lambda: pages_used(triton_server) == 0, timeout=10)
    assert triton_server.metric("dspark_num_requests_running", model="dspark") == 0
    grpc.close()


def test_server_keeps_serving_after_a_cancelled_stream(triton_server):
    with GrpcStream(triton_server) as grpc:
        grpc.send(text_input=LONG_PROMPT, stream=True, sampling_parameters=LONG)
        grpc.next()
        grpc.cancel()
    with GrpcStream(triton_server) as grpc:
        outcome = grpc.send(text_input="Hello", stream=True, sampling_parameters={"max_tokens": 4}).collect()
    assert outcome.error is None and outcome.responses[-1].final


def test_http_cancel_by_request_id_ends_that_stream_with_reason_abort(triton_server):
    result: dict = {}

    def stream() -> None:
        result["status"], result["body"] = triton_server.post(
            "/v2/models/dspark/generate_stream",
            {
                "id": "story-1",
                "text_input": LONG_PROMPT,
                "stream": True,
                "return_finish_reason": True,
                **LONG,
            },
        )

    # The pages of an earlier test's request may still show until the gauge catches up: from none, the
    # pages seen are this stream's.
    assert wait_for(lambda: pages_used(triton_server) == 0)
    thread = threading.Thread(target=stream)
    thread.start()
    status, body = cancel_in_flight(triton_server, "story-1", thread)
    assert status == 200, body
    assert json.loads(body)["finish_reason"] == "cancelled"
    thread.join(60)
    events = [json.loads(line[5:]) for line in result["body"].splitlines() if line.startswith("data:")]
    assert events[-1]["finish_reason"] == "abort"
    assert len(events) < LONG["max_tokens"]
    assert wait_for(lambda: pages_used(triton_server) == 0, timeout=10)


def test_cancel_of_an_unknown_request_id_is_an_error_naming_the_field(triton_server):
    status, body = triton_server.post("/v2/models/dspark/generate", {"cancel_request_id": "no-such-request"})
    assert status == 400
    assert "cancel_request_id" in json.loads(body)["error"]


def test_cancel_all_ends_every_request_in_flight_before_it_answers(triton_server):
    streams = [GrpcStream(triton_server) for _ in range(2)]
    try:
        for grpc in streams:
            grpc.send(
                text_input=LONG_PROMPT, stream=True, sampling_parameters=LONG, return_finish_reason=True
            )
            assert not isinstance(grpc.next(), str)
        status, body = triton_server.post("/v2/models/dspark/generate", {"cancel_request_id": "*"})
        assert status == 200 and json.loads(body)["finish_reason"] == "cancelled"
        assert [grpc.collect(timeout=5).finish_reason for grpc in streams] == ["abort", "abort"]
    finally:
        for grpc in streams:
            grpc.close()
    assert wait_for(lambda: triton_server.metric("dspark_num_requests_running", model="dspark") == 0)


def test_cancelling_a_wrapper_request_by_id_returns_its_partial_completion(triton_server):
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_server.http_url, network_timeout=120)
    inputs = []
    for name, value, datatype in (
        ("text_input", np.array([LONG_PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(LONG).encode()], dtype=np.object_), "BYTES"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        tensor = httpclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(out=client.infer("dspark_generate", inputs, request_id="whole-1"))
    )
    assert wait_for(lambda: pages_used(triton_server) == 0)  # from none: the pages seen are this one's
    thread.start()
    status, body = cancel_in_flight(triton_server, "whole-1", thread)
    assert status == 200, body
    thread.join(60)
    assert result["out"].as_numpy("finish_reason")[0] == b"abort"
    assert result["out"].as_numpy("text_output")[0].decode().startswith(LONG_PROMPT)
