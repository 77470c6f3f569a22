"""Bad requests are rejected alone, naming the field, with a client-error status on every path, while a
good stream beside them finishes unchanged.

Every case is sent four ways: a gRPC stream to `dspark` (the stream protocol carries the message only,
no status code), a gRPC infer to the `dspark_generate` wrapper (status INVALID_ARGUMENT), HTTP
`/v2/models/dspark/generate` (400) and HTTP `/v2/models/dspark_generate/infer` (400). A case that a
path cannot express (raw bytes over JSON, a tensor datatype on the generate endpoint, `stream` on the
wrapper) skips that path.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest
from server_fixtures import GrpcStream, Outcome, TritonServer, grpc_inputs, wait_for

from dspark.sampling_params import (
    MAX_INT,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)

pytestmark = pytest.mark.server

GOOD_PROMPT = "Write a haiku about autumn leaves."
GOOD = {"max_tokens": 6, "ignore_eos": True}
VOCAB = 49152  # SmolLM2-135M's
CONTEXT = 512  # server_fixtures.TEST_ENGINE_CONFIG.max_model_len
GRPC_STREAM, GRPC_WRAPPER, HTTP_GENERATE, HTTP_WRAPPER = (
    "grpc",
    "grpc-wrapper",
    "http-generate",
    "http-wrapper",
)
ALL_PATHS = (GRPC_STREAM, GRPC_WRAPPER, HTTP_GENERATE, HTTP_WRAPPER)
GRPC_ONLY = (GRPC_STREAM, GRPC_WRAPPER)
TENSOR_PATHS = (GRPC_STREAM, GRPC_WRAPPER, HTTP_WRAPPER)  # those that take a tensor's datatype
DSPARK_PATHS = (GRPC_STREAM, HTTP_GENERATE)  # `stream` is not a wrapper input


def _ids(values: list[int], dtype: str = "INT64") -> tuple[np.ndarray, str]:
    return np.array(values, dtype=np.dtype(dtype.lower())), dtype


def _nested(depth: int) -> str:
    """sampling_parameters whose JSON nests `depth` levels deep (the object is level 1)."""
    return '{"stop": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@dataclass
class Bad:
    """A request that must be rejected naming `field`; `values` as server_fixtures.grpc_inputs takes them
    (a dict is the sampling_parameters JSON, a str under sampling_parameters is sent as it is)."""

    values: dict
    field: str
    paths: tuple[str, ...] = ALL_PATHS


def _sampling(field: str, value: object, paths: tuple[str, ...] = ALL_PATHS) -> Bad:
    return Bad({"text_input": "Hi", "sampling_parameters": {field: value}}, field, paths)


def _raw(text: str, field: str, paths: tuple[str, ...] = ALL_PATHS) -> Bad:
    return Bad({"text_input": "Hi", "sampling_parameters": text}, field, paths)


BAD_REQUESTS = {
    # Whole sampling_parameters JSON.
    "malformed_sampling_json": _raw("{max_tokens: 4", "sampling_parameters"),
    "sampling_json_not_an_object": _raw("[1, 2]", "sampling_parameters"),
    "sampling_json_nested_one_past_the_depth_limit": _raw(_nested(MAX_JSON_DEPTH + 1), "sampling_parameters"),
    "sampling_json_nested_10000_deep": _raw(_nested(10_000), "sampling_parameters"),
    "sampling_json_one_byte_past_the_size_limit": _raw(
        '{"max_tokens": 4}' + " " * (MAX_JSON_BYTES - 16), "sampling_parameters"
    ),
    "sampling_json_invalid_utf8": Bad(
        {"text_input": "Hi", "sampling_parameters": (np.array([b'{"stop": "\xff"}'], np.object_), "BYTES")},
        "sampling_parameters",
        GRPC_ONLY,
    ),
    "unknown_sampling_parameter": _sampling("temprature", 0.5),
    # One field each, one past its bound or of the wrong type.
    "max_tokens_zero": _sampling("max_tokens", 0),
    "max_tokens_one_past_int32": _sampling("max_tokens", MAX_INT + 1),
    "max_tokens_10e30": _sampling("max_tokens", 10**30),
    "max_tokens_5000_digits": _raw('{"max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    "max_tokens_a_string": _sampling("max_tokens", "many"),
    "max_tokens_a_float": _sampling("max_tokens", 4.5),
    "temperature_negative": _sampling("temperature", -0.5),
    "temperature_past_its_maximum": _sampling("temperature", MAX_TEMPERATURE + 0.5),
    "temperature_nan": _raw('{"temperature": NaN}', "temperature"),
    "temperature_1e400": _raw('{"temperature": 1e400}', "temperature"),
    "top_p_zero": _sampling("top_p", 0.0),
    "top_p_past_one": _sampling("top_p", 1.0000001),
    "top_p_a_string": _sampling("top_p", "high"),
    "top_k_negative": _sampling("top_k", -1),
    "top_k_one_past_int32": _sampling("top_k", MAX_INT + 1),
    "top_k_10e30": _sampling("top_k", 10**30),
    "seed_negative": _sampling("seed", -1),
    "seed_one_past_the_generator_range": _raw(f'{{"seed": {MAX_SEED + 1}}}', "seed"),
    "seed_18446744073709551621": _raw('{"seed": 18446744073709551621}', "seed"),
    "seed_a_float": _sampling("seed", 1.5),
    "num_draft_tokens_negative": _sampling("num_draft_tokens", -1),
    "num_draft_tokens_one_past_int32": _sampling("num_draft_tokens", MAX_INT + 1),
    "num_draft_tokens_10e30": _sampling("num_draft_tokens", 10**30),
    "stop_empty_string": _sampling("stop", [""]),
    "stop_one_string_too_many": _sampling("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    "stop_string_one_character_too_long": _sampling("stop", ["y" * (MAX_STOP_STRING_CHARS + 1)]),
    "stop_a_number": _sampling("stop", 5),
    "stop_token_ids_negative": _sampling("stop_token_ids", [-1]),
    "stop_token_ids_the_vocabulary_size": _sampling("stop_token_ids", [VOCAB]),
    "stop_token_ids_4294967301": _sampling("stop_token_ids", [4294967301]),
    "stop_token_ids_one_too_many": _sampling("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    "stop_token_ids_not_a_list": _sampling("stop_token_ids", 5),
    "ignore_eos_a_string": _sampling("ignore_eos", "yes"),
    # Prompts.
    "no_prompt_at_all": Bad({"sampling_parameters": {"max_tokens": 4}}, "text_input"),
    "empty_prompt": Bad({"text_input": ""}, "text_input"),
    "prompt_longer_than_the_context": Bad({"text_input": "word " * 600}, "text_input"),
    "prompt_invalid_utf8": Bad(
        {"text_input": (np.array([b"caf\xc3"], np.object_), "BYTES")}, "text_input", GRPC_ONLY
    ),
    "prompt_of_the_wrong_datatype": Bad({"text_input": _ids([7], "INT32")}, "text_input", TENSOR_PATHS),
    "prompt_of_the_wrong_shape": Bad(
        {"text_input": (np.array([b"a", b"b"], np.object_), "BYTES")}, "text_input"
    ),
    "both_text_and_ids": Bad({"text_input": "Hi", "input_ids": _ids([1, 2])}, "input_ids"),
    "empty_input_ids": Bad({"input_ids": _ids([])}, "input_ids"),
    "input_ids_negative": Bad({"input_ids": _ids([1, -1])}, "input_ids"),
    "input_ids_the_vocabulary_size": Bad({"input_ids": _ids([1, VOCAB])}, "input_ids"),
    "input_ids_one_past_int32": Bad({"input_ids": _ids([MAX_INT + 1])}, "input_ids"),
    "input_ids_4294967301": Bad({"input_ids": _ids([4294967301])}, "input_ids"),
    "input_ids_int64_maximum": Bad({"input_ids": _ids([2**63 - 1])}, "input_ids"),
    "input_ids_filling_the_context": Bad({"input_ids": _ids([1] * CONTEXT)}, "input_ids"),
    "input_ids_as_int32": Bad({"input_ids": _ids([1], "INT32")}, "input_ids", TENSOR_PATHS),
    "input_ids_as_uint32": Bad({"input_ids": _ids([1], "UINT32")}, "input_ids", TENSOR_PATHS),
    "input_ids_as_uint64": Bad({"input_ids": _ids([2**64 - 1], "UINT64")}, "input_ids", TENSOR_PATHS),
    "input_ids_of_two_dimensions": Bad({"input_ids": _ids([[1, 2]])}, "input_ids", TENSOR_PATHS),
    "prompt_included_in_a_stream": Bad(
        {"text_input": "Hi", "stream": True, "exclude_input_in_output": False},
        "exclude_input_in_output",
        DSPARK_PATHS,
    ),
    "empty_cancel_request_id": Bad({"cancel_request_id": ""}, "cancel_request_id"),
}


def _grpc_stream(server: TritonServer, values: dict) -> tuple[str | None, str]:
    with GrpcStream(server) as bad:
        outcome = bad.send(**values).collect()
    assert not outcome.responses
    return None, outcome.error or ""


def _grpc_wrapper(server: TritonServer, values: dict) -> tuple[str | None, str]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("dspark_generate", grpc_inputs(**values))
    except InferenceServerException as exc:
        return exc.status(), exc.message()
    finally:
        client.close()
    return "OK", ""


def _http_generate(server: TritonServer, values: dict) -> tuple[str | None, str]:
    body: dict = {}
    for name, value in values.items():
        if name == "sampling_parameters" and isinstance(value, dict) and _scalars(value):
            body.update(value)  # the generate endpoint's request parameters
        elif name == "sampling_parameters" and isinstance(value, dict):
            body[name] = json.dumps(value)
        elif isinstance(value, tuple):
            body[name] = _json_data(value[0])
        else:
            body[name] = value
    status, text = server.post("/v2/models/dspark/generate", body)
    return status, json.loads(text).get("error", text)


def _http_wrapper(server: TritonServer, values: dict) -> tuple[str | None, str]:
    inputs = []
    for name, value in values.items():
        if isinstance(value, dict):
            value = json.dumps(value)
        if isinstance(value, tuple):
            array, datatype = value
            inputs.append(
                {"name": name, "datatype": datatype, "shape": list(array.shape), "data": _json_data(array)}
            )
        elif isinstance(value, bool):
            inputs.append({"name": name, "datatype": "BOOL", "shape": [1], "data": [value]})
        else:
            inputs.append({"name": name, "datatype": "BYTES", "shape": [1], "data": [value]})
    status, text = server.post("/v2/models/dspark_generate/infer", {"inputs": inputs})
    return status, json.loads(text).get("error", text)


def _json_data(array: np.ndarray) -> list:
    """A tensor's values as JSON takes them (BYTES as text)."""
    return (
        [v.decode() if isinstance(v, bytes) else v for v in array.tolist()]
        if array.ndim == 1
        else array.tolist()
    )


def _scalars(values: dict) -> bool:
    """Whether the generate endpoint can carry these as request parameters (int64, float, str, bool)."""
    return all(
        isinstance(v, (float, str, bool)) or (isinstance(v, int) and -(2**63) <= v < 2**63)
        for v in values.values()
    )


SENDERS = {
    GRPC_STREAM: _grpc_stream,
    GRPC_WRAPPER: _grpc_wrapper,
    HTTP_GENERATE: _http_generate,
    HTTP_WRAPPER: _http_wrapper,
}
CLIENT_ERROR = {
    GRPC_STREAM: None,
    GRPC_WRAPPER: "StatusCode.INVALID_ARGUMENT",
    HTTP_GENERATE: 400,
    HTTP_WRAPPER: 400,
}


@pytest.fixture(scope="module")
def good_alone(triton_server) -> Outcome:
    with GrpcStream(triton_server) as grpc:
        return grpc.send(text_input=GOOD_PROMPT, stream=True, sampling_parameters=GOOD).collect()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_rejected_naming_the_field_on_every_path_while_a_good_stream_finishes_unchanged(
    triton_server, good_alone, case
):
    bad = BAD_REQUESTS[case]
    with GrpcStream(triton_server) as good:
        good.send(text_input=GOOD_PROMPT, stream=True, sampling_parameters=GOOD)
        first = good.next()
        assert not isinstance(first, str), first
        answers = {path: SENDERS[path](triton_server, bad.values) for path in bad.paths}
        # The first response may be the whole answer already: a response carries every token the engine
        # committed since the last (the adapter reads the engine's deltas on a tick, and the engine
        # process merges what it holds while the adapter has not read), so on a busy host all six can
        # come at once, and there is no rest to wait for.
        rest = Outcome([], None) if first.final else good.collect()
    for path, (status, message) in answers.items():
        assert (status, bad.field in message) == (CLIENT_ERROR[path], True), (path, status, message)
    assert rest.error is None
    assert first.text + rest.text == good_alone.text
    assert first.ids + rest.ids == good_alone.ids


def _greedy_text(server: TritonServer, **extra: object) -> str:
    status, body = server.post(
        "/v2/models/dspark/generate",
        {"text_input": GOOD_PROMPT, "max_tokens": 8, "ignore_eos": True, **extra},
    )
    assert status == 200, body
    return json.loads(body)["text_output"]


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 5e-324}, {"temperature": 1e-30}, {"temperature": 1.0, "top_p": 1e-46}],
    ids=["temperature_5e-324", "temperature_1e-30", "top_p_1e-46"],
)
def test_tiny_temperature_or_top_p_decodes_as_greedy(triton_server, extra):
    assert _greedy_text(triton_server, seed=1, **extra) == _greedy_text(triton_server)


@pytest.mark.parametrize(
    "values",
    [
        {"seed": MAX_SEED, "temperature": 1.0},
        {"top_k": MAX_INT, "temperature": 1.0},
        {"num_draft_tokens": MAX_INT},
        {"stop": [f"{i:02d}" + "x" * (MAX_STOP_STRING_CHARS - 2) for i in range(MAX_STOP_STRINGS)]},
        {"stop_token_ids": list(range(VOCAB - MAX_STOP_TOKEN_IDS, VOCAB))},
    ],
    ids=["seed", "top_k", "num_draft_tokens", "stop", "stop_token_ids"],
)
def test_a_value_at_its_bound_is_served(triton_server, values):
    with GrpcStream(triton_server) as grpc:
        grpc.send(text_input="Hi", sampling_parameters={"max_tokens": 2, "ignore_eos": True, **values})
        outcome = grpc.collect()
    assert outcome.error is None and len(outcome.ids) == 2


def test_input_ids_at_the_edge_of_the_vocabulary_are_served(triton_server):
    status, body = triton_server.post(
        "/v2/models/dspark/generate", {"input_ids": [0, VOCAB - 1], "max_tokens": 2}
    )
    assert status == 200, body


def test_wrapper_takes_float_request_parameters(triton_server):
    prompt = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}
    parameters = {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 3}
    status, body = triton_server.post(
        "/v2/models/dspark_generate/infer", {"inputs": [prompt], "parameters": parameters}
    )
    assert status == 200, body


def test_server_stays_ready_after_every_bad_request(triton_server):
    status, _ = triton_server.post("/v2/models/dspark/generate", {"text_input": "Hi", "max_tokens": 2})
    assert status == 200
    for model in ("dspark", "dspark_generate"):
        with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/{model}/ready") as ready:
            assert ready.status == 200
    assert triton_server.running
    for name in ("dspark_num_requests_running", "dspark_num_requests_waiting", "dspark_kv_pages_used"):
        assert wait_for(lambda name=name: triton_server.metric(name, model="dspark") == 0), name
