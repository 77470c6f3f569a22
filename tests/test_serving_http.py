"""HTTP: Triton's generate extension on the decoupled model, and tritonclient.http through the wrapper."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
PARAMS = {"max_tokens": 8, "ignore_eos": True}


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data:") :]) for line in body.splitlines() if line.startswith("data:")]


def as_list(value: object) -> list:
    """The generate endpoint writes a one-element output as a scalar."""
    return value if isinstance(value, list) else [value]


@pytest.fixture(scope="module")
def completion(triton_server) -> dict:
    status, body = triton_server.post(
        "/v2/models/dspark/generate",
        {"text_input": PROMPT, "exclude_input_in_output": True, "return_finish_reason": True, **PARAMS},
    )
    assert status == 200, body
    return json.loads(body)


def test_generate_returns_the_prompt_and_completion_in_one_response(triton_server, completion):
    status, body = triton_server.post("/v2/models/dspark/generate", {"text_input": PROMPT, **PARAMS})
    assert status == 200, body
    assert json.loads(body)["text_output"] == PROMPT + completion["text_output"]


def test_generate_takes_bool_inputs_and_scalar_request_parameters(completion):
    assert completion["finish_reason"] == "length"
    assert len(as_list(completion["output_ids"])) == PARAMS["max_tokens"]


def test_generate_takes_sampling_parameters_as_a_json_string(triton_server, completion):
    status, body = triton_server.post(
        "/v2/models/dspark/generate",
        {"text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters": json.dumps(PARAMS)},
    )
    assert status == 200, body
    assert json.loads(body)["text_output"] == completion["text_output"]


def test_generate_stream_sends_only_new_text_per_event_and_the_reason_last(triton_server, completion):
    status, body = triton_server.post(
        "/v2/models/dspark/generate_stream",
        {"text_input": PROMPT, "stream": True, "return_finish_reason": True, **PARAMS},
    )
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == completion["text_output"]
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]


def test_generate_stream_reports_a_bad_request_as_an_error_naming_the_field(triton_server):
    status, body = triton_server.post(
        "/v2/models/dspark/generate_stream", {"text_input": PROMPT, "stream": True, "top_p": 7}
    )
    assert status == 400
    assert "top_p" in sse_events(body)[0]["error"]


def test_tritonclient_http_infer_through_the_wrapper_returns_the_whole_completion(triton_server, completion):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_server.http_url)
    inputs = []
    for name, value, datatype in (
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([json.dumps(PARAMS).encode()], dtype=np.object_), "BYTES"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
    ):
        tensor = httpclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer("dspark_generate", inputs)
    assert result.as_numpy("text_output")[0].decode() == completion["text_output"]
    assert result.as_numpy("output_ids").tolist() == as_list(completion["output_ids"])


def test_wrapper_reports_a_bad_request_as_an_error_naming_the_field(triton_server):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(triton_server.http_url)
    tensor = httpclient.InferInput("sampling_parameters", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b'{"max_tokens": 0}'], dtype=np.object_))
    prompt = httpclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="sampling_parameters.max_tokens"):
        client.infer("dspark_generate", [prompt, tensor])
