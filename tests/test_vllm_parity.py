"""Triton's vLLM backend's interface conventions, without a server: sampling parameters read as that
backend reads them (strings converted to each field's annotated type), vLLM parameters this engine
lacks refused by name, vLLM's max_tokens default, skip_special_tokens, and the `vllm:` metric families."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_serving_metrics_families import FakeFamily, metric, stats_after

from dspark.engine.output_processor import OutputProcessor
from dspark.sampling_params import (
    UNSUPPORTED_PARAMETERS,
    InvalidParameterError,
    SamplingParams,
    _scalar_kinds,
)
from dspark.sequence import Sequence
from dspark.serving.metrics import (
    VLLM_E2E_BUCKETS,
    VLLM_N_BUCKETS,
    VLLM_TPOT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    TritonMetrics,
    vllm_token_buckets,
)
from dspark.tokenizer import Tokenizer

SCALAR_FIELDS = {name: kind for name, kind in _scalar_kinds(SamplingParams).items() if kind is not None}


def _valid_value(name: str, kind: type) -> bool | int | float:
    """A value the field accepts: its default, or 0 of its kind when the default is None."""
    default = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == name)
    return default if default is not None else kind(0)


def _as_string(value: bool | int | float) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def test_every_number_and_boolean_field_is_found_from_the_annotations():
    assert {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "ignore_eos",
        "skip_special_tokens",
    } <= set(SCALAR_FIELDS)
    assert {"stop", "stop_token_ids"}.isdisjoint(SCALAR_FIELDS)


@pytest.mark.parametrize("name", sorted(SCALAR_FIELDS))
def test_a_string_value_is_read_as_the_type_its_field_is_annotated_with(name):
    kind = SCALAR_FIELDS[name]
    value = _valid_value(name, kind)
    parsed = getattr(SamplingParams.from_dict({name: _as_string(value)}), name)
    assert type(parsed) is kind and parsed == value


@pytest.mark.parametrize(
    ("name", "text"),
    [("max_tokens", "32.5"), ("max_tokens", "ten"), ("temperature", "warm"), ("ignore_eos", "yes")],
)
def test_a_string_that_is_not_of_the_field_s_type_is_rejected_naming_the_field(name, text):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_dict({name: text})
    assert info.value.field == name and repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "value"), [("true", True), ("True", True), ("FALSE", False), (" false ", False)]
)
def test_boolean_strings_mean_what_they_say(text, value):
    assert SamplingParams.from_dict({"ignore_eos": text}).ignore_eos is value


def test_the_vllm_backend_s_own_client_parameters_parse():
    # samples/client.py and the ci/ tests of triton-inference-server/vllm_backend
    params = SamplingParams.from_json('{"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}')
    assert (params.temperature, params.top_p, params.max_tokens) == (0.1, 0.95, 100)
    greedy = SamplingParams.from_json('{"temperature": "0", "top_p": "1", "max_tokens": "1500"}')
    assert greedy.greedy and greedy.max_tokens == 1500


def test_max_tokens_defaults_to_vllm_s_16():
    assert SamplingParams().max_tokens == 16
    assert SamplingParams.from_json("{}").max_tokens == 16


ACCEPTED_UNSUPPORTED = [
    ("n", 1),
    ("n", "1"),
    ("best_of", 1),
    ("best_of", None),
    ("use_beam_search", False),
    ("use_beam_search", "false"),
    ("structured_outputs", None),
    ("guided_json", None),
]
REFUSED_UNSUPPORTED = [
    ("n", 2),
    ("n", "4"),
    ("n", True),
    ("best_of", 3),
    ("use_beam_search", True),
    ("use_beam_search", "true"),
    ("structured_outputs", {"json": {"type": "object"}}),
    ("structured_outputs", '{"choice": ["a", "b"]}'),
    *[(name, "x") for name in UNSUPPORTED_PARAMETERS if name.startswith("guided_")],
]


@pytest.mark.parametrize(("name", "value"), ACCEPTED_UNSUPPORTED)
def test_an_unimplemented_vllm_parameter_at_the_value_that_asks_for_nothing_is_accepted(name, value):
    assert SamplingParams.from_dict({name: value, "max_tokens": 3}).max_tokens == 3


@pytest.mark.parametrize(("name", "value"), REFUSED_UNSUPPORTED)
def test_an_unimplemented_vllm_parameter_asking_for_something_is_refused_naming_it(name, value):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_dict({name: value})
    assert info.value.field == name
    assert "not supported" in str(info.value) or "only 1" in str(info.value)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decides_whether_special_tokens_reach_the_text(tokenizer, skip):
    special = tokenizer.token_to_id("<|im_end|>")
    words = tokenizer.encode(" one two", add_special_tokens=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True, skip_special_tokens=skip)
    processor = OutputProcessor(
        Sequence("r", 0, tokenizer.encode("Count:"), params, None), tokenizer, [], 512
    )
    committed, text, _ = processor.commit([*words, special, *words])
    assert committed == [*words, special, *words]
    assert text == (" one two one two" if skip else " one two<|im_end|> one two")


def make_metrics() -> TritonMetrics:
    FakeFamily.created = {}
    return TritonMetrics(FakeFamily, {"model": "dspark", "version": "1"}, max_model_len=512)


def test_vllm_families_have_the_vllm_backend_s_names_kinds_and_buckets():
    make_metrics()
    kinds = {name: family.kind for name, family in FakeFamily.created.items() if name.startswith("vllm:")}
    assert kinds == {
        "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:spec_decode_num_drafts_total": "counter",
        "vllm:spec_decode_num_draft_tokens_total": "counter",
        "vllm:spec_decode_num_accepted_tokens_total": "counter",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    }
    assert metric("vllm:time_to_first_token_seconds").buckets == VLLM_TTFT_BUCKETS
    assert metric("vllm:time_per_output_token_seconds").buckets == VLLM_TPOT_BUCKETS
    assert metric("vllm:e2e_request_latency_seconds").buckets == VLLM_E2E_BUCKETS
    assert metric("vllm:request_params_n").buckets == VLLM_N_BUCKETS
    assert metric("vllm:request_prompt_tokens").buckets == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert metric("vllm:request_generation_tokens").buckets == vllm_token_buckets(512)
    labels = next(iter(FakeFamily.created["vllm:prompt_tokens_total"].metrics))
    assert dict(labels) == {"model": "dspark", "version": "1"}


def test_vllm_token_and_latency_families_follow_the_requests():
    metrics = make_metrics()
    metrics.prompt_tokens(7)
    metrics.tokens_generated(1, since_arrival=0.2, since_last=None)
    metrics.tokens_generated(3, since_arrival=None, since_last=0.09)
    metrics.request_completed(prompt_tokens=7, generation_tokens=4, e2e_latency=0.35)
    metrics.flush()
    assert metric("vllm:prompt_tokens_total").value == 7
    assert metric("vllm:generation_tokens_total").value == 4
    assert metric("vllm:time_to_first_token_seconds").observed == [0.2]
    itl = metric("dspark_inter_token_latency_seconds").observed
    assert itl
    assert metric("vllm:time_per_output_token_seconds").observed == itl == pytest.approx([0.03] * len(itl))
    assert metric("vllm:e2e_request_latency_seconds").observed == [0.35]
    assert metric("vllm:request_prompt_tokens").observed == [7]
    assert metric("vllm:request_generation_tokens").observed == [4]
    assert metric("vllm:request_params_n").observed == [1]


def test_vllm_spec_decode_counters_count_drafting_steps_verified_drafts_and_acceptances_by_position():
    metrics = make_metrics()
    first = stats_after((7, 3, 2))
    metrics.speculation(None, first)
    metrics.speculation(first, stats_after((7, 3, 2), (0, 0, 0), (7, 2, 1)))
    metrics.flush()
    assert metric("vllm:spec_decode_num_drafts_total").value == 2
    assert metric("vllm:spec_decode_num_draft_tokens_total").value == 5
    assert metric("vllm:spec_decode_num_accepted_tokens_total").value == 3
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert metric(per_position, position="0").value == 2
    assert metric(per_position, position="1").value == 1
    assert ("position", "2") not in {kv for key in FakeFamily.created[per_position].metrics for kv in key}
