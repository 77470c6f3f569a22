"""SamplingParams validation: every bound accepted at its edge, one past it rejected naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.sampling_params import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_INT,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    InvalidParameterError,
    SamplingParams,
)

# field: (values at the bound, accepted; values one past it, rejected)
BOUNDS = {
    "max_tokens": ([1, MAX_INT, "4", " +4 "], [0, MAX_INT + 1, 10**30, 1.0, "4.0", "0", "many", True]),
    "temperature": (
        [0.0, 0, MAX_TEMPERATURE, "0", "0.7"],
        [-1e-300, MAX_TEMPERATURE * 1.01, float("nan"), float("inf"), "nan", "1e400", "hot"],
    ),
    "top_p": ([1e-46, 5e-324, 1.0, 1, "0.5"], [0.0, 1.0000001, -0.5, float("nan"), "0", "high"]),
    "top_k": ([0, MAX_INT], [-1, MAX_INT + 1, 10**30, 2.0]),
    "seed": ([0, MAX_SEED, "1"], [-1, MAX_SEED + 1, 18446744073709551621, 1.5, "1.5", "-1"]),
    "num_draft_tokens": ([0, MAX_INT], [-1, MAX_INT + 1, 10**30, 1.0]),
    "presence_penalty": ([-MAX_PENALTY, MAX_PENALTY, 0, 0.5], [-2.0001, 2.0001, float("nan"), [1.0], True]),
    "frequency_penalty": ([-MAX_PENALTY, MAX_PENALTY, 0], [-2.0001, 2.0001, float("inf"), {"a": 1}]),
    "repetition_penalty": ([1e-9, MAX_REPETITION_PENALTY, 1], [0.0, -1.0, 2.0001, float("nan"), False]),
    "min_tokens": ([0, 1], [-1, 1.0, 10**30, True]),  # and at most max_tokens (test_penalties.py)
    "logprobs": ([0, MAX_LOGPROBS], [-1, MAX_LOGPROBS + 1, 1.0, True]),
    "stop": (
        [["x"] * MAX_STOP_STRINGS, ["y" * MAX_STOP_STRING_CHARS], "z"],
        [
            ["x"] * (MAX_STOP_STRINGS + 1),
            ["y" * (MAX_STOP_STRING_CHARS + 1)],
            [""],
            [1],
            ["a", None],
            {"a": 1},
        ],
    ),
    "stop_token_ids": (
        [[0, MAX_INT], list(range(MAX_STOP_TOKEN_IDS))],
        [[-1], [MAX_INT + 1], list(range(MAX_STOP_TOKEN_IDS + 1)), [1.0], "1", [[1]]],
    ),
    "ignore_eos": ([True, False, "true", "False"], [1, "yes", "1", ""]),
    "skip_special_tokens": ([True, False, "false"], [0, "no"]),
}
ACCEPTED = [(name, value) for name, (good, _) in BOUNDS.items() for value in good]
REJECTED = [(name, value) for name, (_, bad) in BOUNDS.items() for value in bad]


@pytest.mark.parametrize(("name", "value"), ACCEPTED, ids=[f"{n}={v!r:.40}" for n, v in ACCEPTED])
def test_a_value_at_its_bound_is_accepted(name, value) -> None:
    SamplingParams.from_dict({name: value})


@pytest.mark.parametrize(("name", "value"), REJECTED, ids=[f"{n}={v!r:.40}" for n, v in REJECTED])
def test_a_value_past_its_bound_is_rejected_naming_the_field(name, value) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_dict({name: value})
    assert info.value.field == name
    assert str(info.value).startswith(f"{name}: ")


@pytest.mark.parametrize("seed", [0, 2**63, MAX_SEED])
def test_every_accepted_seed_seeds_a_torch_generator(seed) -> None:
    params = SamplingParams(seed=seed)
    assert torch.Generator().manual_seed(params.seed).initial_seed() == seed


def test_the_seed_past_the_range_is_one_torch_refuses() -> None:
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        torch.Generator().manual_seed(MAX_SEED + 1)


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_temperature_below_the_threshold_decodes_greedily(temperature) -> None:
    assert SamplingParams(temperature=temperature).greedy


def test_a_temperature_at_the_threshold_samples() -> None:
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy


def test_an_integer_too_long_to_convert_is_rejected_naming_its_field() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json('{"max_tokens": ' + "9" * 5000 + "}")
    assert info.value.field == "max_tokens"
    assert "5000-digit" in str(info.value)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100, 10_000])
def test_json_nested_past_the_depth_limit_is_rejected(depth) -> None:
    text = '{"stop": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json(text)
    assert info.value.field == "sampling_parameters"
    assert "nested" in str(info.value)


def test_json_at_the_depth_limit_reaches_validation() -> None:
    text = '{"stop": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json(text)
    assert info.value.field == "stop"


def test_json_at_the_size_limit_is_parsed_and_one_byte_more_is_rejected() -> None:
    body = json.dumps({"max_tokens": 4})
    at_limit = body + " " * (MAX_JSON_BYTES - len(body))
    assert SamplingParams.from_json(at_limit).max_tokens == 4
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json(at_limit + " ")
    assert info.value.field == "sampling_parameters"
    assert str(MAX_JSON_BYTES) in str(info.value)


@pytest.mark.parametrize("text", ["{max_tokens: 4", "[1, 2]", '"x"', "NaN-ish", '{"a": 1e}'])
def test_text_that_is_not_a_json_object_is_rejected_naming_sampling_parameters(text) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_json(text)
    assert info.value.field == "sampling_parameters"
