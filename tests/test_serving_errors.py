"""Bad requests get a Triton error naming the field, on their own stream, while others stream on."""

from __future__ import annotations

import numpy as np
import pytest
from server_fixtures import GrpcStream, Outcome

pytestmark = pytest.mark.server

GOOD_PROMPT = "Write a haiku about autumn leaves."
GOOD = {"max_tokens": 6, "ignore_eos": True}

BAD_REQUESTS = {
    "malformed_sampling_json": (
        {"text_input": "Hi", "sampling_parameters": "{max_tokens: 4"},
        "sampling_parameters",
    ),
    "unknown_sampling_parameter": (
        {"text_input": "Hi", "sampling_parameters": {"temprature": 0.5}},
        "sampling_parameters.temprature",
    ),
    "out_of_range_parameter": (
        {"text_input": "Hi", "sampling_parameters": {"top_p": 1.5}},
        "sampling_parameters.top_p",
    ),
    "wrongly_typed_parameter": (
        {"text_input": "Hi", "sampling_parameters": {"max_tokens": "many"}},
        "sampling_parameters.max_tokens",
    ),
    "wrong_input_datatype": ({"text_input": (np.array([7], dtype=np.int32), "INT32")}, "text_input"),
    "wrong_input_shape": ({"text_input": (np.array([b"a", b"b"], dtype=np.object_), "BYTES")}, "text_input"),
    "empty_prompt": ({"text_input": ""}, "text_input"),
    "prompt_longer_than_the_context": ({"text_input": "word " * 600}, "text_input"),
    "empty_input_ids": ({"input_ids": []}, "input_ids"),
    "token_id_outside_the_vocabulary": ({"input_ids": [1, 10_000_000]}, "input_ids"),
    "no_prompt_at_all": ({"sampling_parameters": {"max_tokens": 4}}, "text_input"),
    "prompt_included_in_a_stream": (
        {"text_input": "Hi", "stream": True, "exclude_input_in_output": False},
        "exclude_input_in_output",
    ),
}


@pytest.fixture(scope="module")
def good_alone(triton_server) -> Outcome:
    with GrpcStream(triton_server) as grpc:
        return grpc.send(text_input=GOOD_PROMPT, stream=True, sampling_parameters=GOOD).collect()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_an_error_naming_the_field_while_a_good_stream_finishes_unchanged(
    triton_server, good_alone, case
):
    values, field = BAD_REQUESTS[case]
    with GrpcStream(triton_server) as good, GrpcStream(triton_server) as bad:
        good.send(text_input=GOOD_PROMPT, stream=True, sampling_parameters=GOOD)
        first = good.next()
        assert not isinstance(first, str), first
        outcome = bad.send(**values).collect()
        rest = good.collect()
    assert outcome.error is not None and not outcome.responses
    assert field in outcome.error
    assert rest.error is None
    assert first.text + rest.text == good_alone.text
    assert first.ids + rest.ids == good_alone.ids


def test_server_stays_ready_after_every_bad_request(triton_server):
    status, _ = triton_server.post("/v2/models/dspark/generate", {"text_input": "Hi", "max_tokens": 2})
    assert status == 200
    assert triton_server.running
