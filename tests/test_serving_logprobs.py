"""Log probabilities and penalties through a real tritonserver: the vLLM backend's `logprobs` and
`cumulative_logprob` outputs, unchanged by speculation (CPU fp32), and penalized requests that decode
the same with speculation on and off."""

from __future__ import annotations

import json
import math

import pytest
from server_fixtures import GrpcStream, Outcome

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
TOLERANCE = 1e-4  # fp32 logits of one position, computed in verify windows of different shapes


def generate(server, stream: bool = True, **values: object) -> Outcome:
    with GrpcStream(server) as grpc:
        outcome = grpc.send(
            text_input=PROMPT,
            stream=stream,
            exclude_input_in_output=True,
            return_logprobs=True,
            return_cumulative_logprob=True,
            return_num_output_tokens=True,
            return_spec_stats=True,
            **values,
        ).collect()
    assert outcome.error is None, outcome.error
    return outcome


def logprobs_of(outcome: Outcome) -> list[dict]:
    """Every token's {token id: {logprob, rank, decoded_token}}, over the responses in order."""
    return [entry for r in outcome.responses for entry in json.loads(r.outputs["logprobs"][0])]


def cumulative(outcome: Outcome) -> float:
    return float(outcome.responses[-1].outputs["cumulative_logprob"][0])


def accepted(outcome: Outcome) -> int:
    return json.loads(outcome.responses[-1].outputs["spec_stats"][0])["accepted_tokens"]


@pytest.fixture(scope="module")
def speculative(triton_server) -> Outcome:
    return generate(triton_server, sampling_parameters=GREEDY)


@pytest.fixture(scope="module")
def plain(triton_server) -> Outcome:
    return generate(triton_server, sampling_parameters={**GREEDY, "num_draft_tokens": 0})


def test_greedy_logprobs_with_speculation_equal_those_without(speculative, plain):
    assert accepted(speculative) > 0 and accepted(plain) == 0
    assert speculative.ids == plain.ids
    on, off = logprobs_of(speculative), logprobs_of(plain)
    assert len(on) == len(off) == GREEDY["max_tokens"]
    for a, b in zip(on, off, strict=True):
        assert list(a) == list(b)
        for token_id in a:
            assert a[token_id]["rank"] == b[token_id]["rank"]
            assert a[token_id]["decoded_token"] == b[token_id]["decoded_token"]
            assert abs(a[token_id]["logprob"] - b[token_id]["logprob"]) < TOLERANCE
    assert abs(cumulative(speculative) - cumulative(plain)) < TOLERANCE * len(on)


def test_logprobs_have_the_vllm_backend_shape(speculative):
    """What the vLLM backend's additional-outputs test checks of every response."""
    text = ""
    previous = 0.0
    for response in speculative.responses:
        entries = json.loads(response.outputs["logprobs"][0])
        assert len(entries) == int(response.outputs["num_output_tokens"][0]) == len(response.ids) >= 1
        for token, entry in zip(response.ids, entries, strict=True):
            assert str(token) in entry and 1 <= len(entry) <= GREEDY["logprobs"] + 1
            assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
            assert all(isinstance(v["logprob"], float) and isinstance(v["rank"], int) for v in entry.values())
            assert [v["rank"] for v in entry.values()].count(1) == 1
            text += entry[str(token)]["decoded_token"]  # greedy: the chosen token is rank 1
            assert entry[str(token)]["rank"] == 1
        value = float(response.outputs["cumulative_logprob"][0])
        assert value < previous  # every token adds a negative log probability
        previous = value
    assert text == speculative.text
    pairs = zip(logprobs_of(speculative), speculative.ids, strict=True)
    total = sum(entry[str(token)]["logprob"] for entry, token in pairs)
    assert math.isclose(cumulative(speculative), total, rel_tol=1e-4)


def test_a_non_streamed_response_holds_every_tokens_logprobs(triton_server, speculative):
    whole = generate(triton_server, stream=False, sampling_parameters=GREEDY)
    assert len(whole.responses) == 1 and whole.ids == speculative.ids
    assert len(logprobs_of(whole)) == len(whole.ids)
    assert abs(cumulative(whole) - cumulative(speculative)) < TOLERANCE * len(whole.ids)


def test_without_sampling_logprobs_the_outputs_are_null_and_nan(triton_server):
    outcome = generate(triton_server, sampling_parameters={"max_tokens": 4})
    assert all(json.loads(r.outputs["logprobs"][0]) is None for r in outcome.responses)
    assert all(math.isnan(float(r.outputs["cumulative_logprob"][0])) for r in outcome.responses)
    with GrpcStream(triton_server) as grpc:
        bare = grpc.send(text_input=PROMPT, stream=True, sampling_parameters={"max_tokens": 4}).collect()
    assert bare.error is None
    assert all("logprobs" not in r.outputs and "cumulative_logprob" not in r.outputs for r in bare.responses)


def test_penalized_greedy_output_is_the_same_with_speculation_on_and_off(triton_server):
    penalized = {
        "max_tokens": 32,
        "temperature": 0.0,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
        "min_tokens": 20,
    }
    on = generate(triton_server, sampling_parameters=penalized)
    off = generate(triton_server, sampling_parameters={**penalized, "num_draft_tokens": 0})
    unpenalized = generate(triton_server, sampling_parameters={"max_tokens": 32, "temperature": 0.0})
    assert accepted(on) > 0
    assert on.ids == off.ids and on.text == off.text
    assert on.ids != unpenalized.ids
    assert len(on.ids) > 20


def test_out_of_range_penalties_and_logprobs_are_rejected_naming_the_field(triton_server):
    for field, value in [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("min_tokens", 100),
    ]:
        with GrpcStream(triton_server) as grpc:
            outcome = grpc.send(
                text_input=PROMPT, sampling_parameters={"max_tokens": 8, field: value}
            ).collect()
        assert outcome.error is not None and f"sampling_parameters.{field}" in outcome.error, outcome.error
