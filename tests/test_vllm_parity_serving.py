"""Triton's vLLM backend's interface on the real server: genai-perf's kserve payload, string-typed
sampling values on every path, vLLM's max_tokens default, unsupported vLLM parameters refused by name,
the cancellation log line, and the `vllm:` metric families."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
from server_fixtures import GrpcStream, TritonServer, grpc_inputs, wait_for

from dspark.sampling_params import UNSUPPORTED_PARAMETERS, SamplingParams

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
NUMBERS = {"temperature": 0, "top_p": 1, "max_tokens": 5, "ignore_eos": True}
STRINGS = {"temperature": "0", "top_p": "1", "max_tokens": "5", "ignore_eos": "true"}
# vllm.SamplingParams' keys (and the vLLM backend's lora_name): each this engine lacks must be refused.
VLLM_SAMPLING_KEYS = (
    "n best_of presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p seed "
    "stop stop_token_ids bad_words ignore_eos max_tokens min_tokens logprobs prompt_logprobs detokenize "
    "skip_special_tokens spaces_between_special_tokens logits_processors include_stop_str_in_output "
    "truncate_prompt_tokens output_kind structured_outputs guided_decoding logit_bias allowed_token_ids "
    "extra_args lora_name"
).split()
REFUSED_VALUES = {"n": 2, "best_of": 2, "use_beam_search": True}
UNSUPPORTED = sorted(
    (set(VLLM_SAMPLING_KEYS) | set(UNSUPPORTED_PARAMETERS))
    - {f.name for f in dataclasses.fields(SamplingParams)}
)


def _text(outcome) -> str:  # noqa: ANN001 - server_fixtures.Outcome
    assert outcome.error is None, outcome.error
    return outcome.text


@pytest.mark.parametrize(
    "sampling_parameters",
    ['{"max_tokens": "32"}', '{"max_tokens": "32", "min_tokens": "32"}'],
    ids=["streaming", "output_tokens_deterministic"],
)
def test_genai_perf_s_kserve_payload_gets_a_streamed_completion(triton_server, sampling_parameters):
    # genai_perf/inputs/converters/vllm_converter.py (triton-inference-server/perf_analyzer): text_input,
    # exclude_input_in_output [true], stream [true] with --streaming, sampling_parameters with the numbers
    # as strings (min_tokens too with --output-tokens-deterministic), over a gRPC stream.
    with GrpcStream(triton_server) as grpc:
        outcome = grpc.send(
            text_input="Once upon a time, a little robot",
            exclude_input_in_output=True,
            stream=True,
            sampling_parameters=sampling_parameters,
        ).collect()
    assert outcome.error is None, outcome.error
    assert len(outcome.responses) > 1 and outcome.text
    asked = json.loads(sampling_parameters)
    if "min_tokens" in asked:
        assert len(outcome.ids) == int(asked["max_tokens"])
    else:
        assert 1 <= len(outcome.ids) <= int(asked["max_tokens"])


@pytest.fixture(scope="module")
def greedy_with_numbers(triton_server) -> str:
    with GrpcStream(triton_server) as grpc:
        return _text(
            grpc.send(text_input=PROMPT, exclude_input_in_output=True, sampling_parameters=NUMBERS).collect()
        )


def _grpc_tensor(server: TritonServer) -> str:
    with GrpcStream(server) as grpc:
        return _text(
            grpc.send(text_input=PROMPT, exclude_input_in_output=True, sampling_parameters=STRINGS).collect()
        )


def _grpc_request_parameters(server: TritonServer) -> str:
    with GrpcStream(server) as grpc:
        inputs = grpc_inputs(text_input=PROMPT, exclude_input_in_output=True)
        grpc.client.async_stream_infer("dspark", inputs, parameters=STRINGS)
        grpc.in_flight = True
        return _text(grpc.collect())


def _http_generate_top_level_keys(server: TritonServer) -> str:
    status, body = server.post(
        "/v2/models/dspark/generate", {"text_input": PROMPT, "exclude_input_in_output": True, **STRINGS}
    )
    assert status == 200, body
    return json.loads(body)["text_output"]


def _http_wrapper_request_parameters(server: TritonServer) -> str:
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
        {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": [1], "data": [True]},
    ]
    status, body = server.post("/v2/models/dspark_generate/infer", {"inputs": inputs, "parameters": STRINGS})
    assert status == 200, body
    output = next(o for o in json.loads(body)["outputs"] if o["name"] == "text_output")
    return output["data"][0]


def _grpc_wrapper_tensor(server: TritonServer) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = grpc_inputs(text_input=PROMPT, exclude_input_in_output=True, sampling_parameters=STRINGS)
        result = client.infer("dspark_generate", inputs)
    finally:
        client.close()
    return result.as_numpy("text_output").reshape(-1)[0].decode()


PATHS = {
    "grpc_sampling_parameters_tensor": _grpc_tensor,
    "grpc_request_parameters": _grpc_request_parameters,
    "http_generate_top_level_keys": _http_generate_top_level_keys,
    "http_wrapper_request_parameters": _http_wrapper_request_parameters,
    "grpc_wrapper_sampling_parameters_tensor": _grpc_wrapper_tensor,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_string_sampling_values_are_served_as_the_numbers_they_spell_on_every_path(
    triton_server, greedy_with_numbers, path
):
    assert PATHS[path](triton_server) == greedy_with_numbers


def test_a_request_without_max_tokens_generates_vllm_s_default_of_16(triton_server):
    status, body = triton_server.post(
        "/v2/models/dspark/generate",
        {"text_input": PROMPT, "ignore_eos": "true", "return_finish_reason": True},
    )
    assert status == 200, body
    answer = json.loads(body)
    assert len(answer["output_ids"]) == 16 and answer["finish_reason"] == "length"


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_every_vllm_parameter_this_engine_lacks_gets_a_400_naming_it(triton_server, name):
    value = REFUSED_VALUES.get(name, {"a": 1} if name in ("structured_outputs", "logit_bias") else 2)
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 2, name: value})}
    status, text = triton_server.post("/v2/models/dspark/generate", body)
    assert status == 400, text
    assert json.loads(text)["error"].startswith(f"sampling_parameters.{name}: "), text


def test_a_cancelled_request_is_logged_with_the_vllm_backend_s_lines(triton_server):
    request_id = f"cancel-me-{uuid.uuid4().hex[:8]}"
    aborted_before = triton_server.aborted_requests()
    with GrpcStream(triton_server) as grpc:
        grpc.send(
            request_id=request_id,
            text_input="Write an original and creative poem of at least 200 words.",
            sampling_parameters={"max_tokens": "1500", "ignore_eos": "true"},
        )
        assert wait_for(lambda: triton_server.metric("dspark_num_requests_running", model="dspark") == 1)
        grpc.cancel()
        assert "cancel" in str(grpc.next(timeout=30)).lower()
    line = f"[vllm] Cancelling the request (dspark: '{request_id}' cancelled)"
    assert wait_for(lambda: line in triton_server.log_text(), timeout=10), triton_server.log_tail()
    # Written after the abort is handed to the engine, and each line reaches the server's log by a round
    # trip of its own: it may land a moment after the first.
    success = "[vllm] Successfully cancelled the request"
    assert wait_for(lambda: success in triton_server.log_text().split(line, 1)[1], timeout=10), (
        triton_server.log_tail()
    )
    # The log lines follow the abort's request; the request ends (and is counted) at the engine's next
    # step, which a later test's metric baseline must not straddle.
    assert wait_for(lambda: triton_server.aborted_requests() == aborted_before + 1, timeout=30)


VLLM_SERIES = [
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:request_prompt_tokens_count",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_count",
    "vllm:request_generation_tokens_sum",
    "vllm:request_params_n_sum",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "dspark_prompt_tokens_total",
    "dspark_inter_token_latency_seconds_count",
    "dspark_spec_drafting_steps_total",
    "dspark_spec_verified_tokens_total",
    "dspark_spec_accepted_tokens_total",
]


def _series(server: TritonServer) -> dict[str, float]:
    return {name: server.metric(name, model="dspark", version="1") or 0.0 for name in VLLM_SERIES}


def _settled(server: TritonServer) -> dict[str, float]:
    """The series once nothing runs and two readings a flush apart agree (an earlier test's request,
    cancelled, may still be counted)."""
    readings = [_series(server)]

    def still() -> bool:
        readings.append(_series(server))
        running = server.metric("dspark_num_requests_running", model="dspark")
        return running == 0 and readings[-1] == readings[-2]

    assert wait_for(still, interval=0.3)
    return readings[-1]


def test_vllm_metric_families_follow_the_requests_on_the_server(triton_server):
    before = _settled(triton_server)
    with GrpcStream(triton_server) as grpc:
        for prompt in ("The most dangerous animal is", "The future of AI is"):
            outcome = grpc.send(
                text_input=prompt, sampling_parameters={"max_tokens": "6", "ignore_eos": "true"}
            )
            assert outcome.collect().error is None

    def moved() -> dict[str, float]:
        now = _series(triton_server)
        return {name: now[name] - before[name] for name in VLLM_SERIES}

    assert wait_for(lambda: moved()["vllm:generation_tokens_total"] == 12), moved()
    delta = moved()
    assert delta["vllm:prompt_tokens_total"] == delta["dspark_prompt_tokens_total"] > 0
    assert delta["vllm:request_prompt_tokens_sum"] == delta["vllm:prompt_tokens_total"]
    assert delta["vllm:request_generation_tokens_sum"] == 12
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_params_n_sum",
    ):
        assert delta[name] == 2, name
    assert delta["vllm:e2e_request_latency_seconds_sum"] > 0
    assert (
        delta["vllm:time_per_output_token_seconds_count"]
        == delta["dspark_inter_token_latency_seconds_count"]
        > 0
    )
    assert delta["vllm:spec_decode_num_drafts_total"] == delta["dspark_spec_drafting_steps_total"] > 0
    assert delta["vllm:spec_decode_num_draft_tokens_total"] == delta["dspark_spec_verified_tokens_total"] > 0
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] == delta["dspark_spec_accepted_tokens_total"]
    text = triton_server.metrics_text()
    assert 'vllm:time_to_first_token_seconds_bucket{model="dspark",version="1",le="0.001"}' in text
    assert 'vllm:request_prompt_tokens_bucket{model="dspark",version="1",le="500"}' in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model="dspark",position="0",version="1"}' in text
    )


def test_a_stream_asking_for_the_prompt_gets_the_vllm_backends_exact_error(triton_server):
    with GrpcStream(triton_server) as grpc:
        outcome = grpc.send(text_input=PROMPT, stream=True, exclude_input_in_output=False).collect()
    assert outcome.error == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    )
    assert not outcome.responses
