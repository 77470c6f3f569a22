"""A Triton request's inputs read as engine values (dspark.serving.request_inputs), without a server:
the module imports outside the backend stub, and a bad input's error names the request's own input."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from dspark.sampling_params import InvalidParameterError
from dspark.serving.request_inputs import STREAMED_PROMPT_REFUSED, describe, generate_inputs


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeRequest:
    def __init__(self, parameters: str = "", **inputs: object) -> None:
        self._parameters = parameters
        self._inputs = [FakeTensor(name, _array(value)) for name, value in inputs.items()]

    def inputs(self) -> list[FakeTensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters


def _array(value: object) -> np.ndarray:
    if isinstance(value, str | bytes):
        return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    return np.array(value if isinstance(value, list) else [value])


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):  # noqa: ANN001, ANN201 - a stand-in for the stub's triton_python_backend_utils
    fake = types.ModuleType("triton_python_backend_utils")
    fake.get_input_tensor_by_name = lambda request, name: next(
        (tensor for tensor in request.inputs() if tensor.name() == name), None
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def error_text(request: FakeRequest) -> str:
    with pytest.raises(InvalidParameterError) as caught:
        generate_inputs(request)
    return describe(caught.value)


def test_the_module_imports_outside_the_backend_stub() -> None:
    code = (
        "import sys, dspark.serving.request_inputs; assert 'triton_python_backend_utils' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_text_request_becomes_a_prompt_params_and_flags() -> None:
    request = FakeRequest(
        text_input="Hi",
        stream=True,
        sampling_parameters='{"max_tokens": "4", "temperature": 0}',
        return_finish_reason=True,
        return_spec_stats=False,
    )
    inputs = generate_inputs(request)
    assert (inputs.text, inputs.token_ids, inputs.stream, inputs.exclude_input) == ("Hi", None, True, False)
    assert not inputs.chat
    assert inputs.params.max_tokens == 4 and inputs.params.greedy
    assert inputs.returns == frozenset({"return_finish_reason"})


def test_apply_chat_template_marks_the_text_as_one_user_turn() -> None:
    assert generate_inputs(FakeRequest(text_input="Hi", apply_chat_template=True)).chat
    assert not generate_inputs(FakeRequest(text_input="Hi", apply_chat_template=False)).chat


def test_request_parameters_stand_in_for_sampling_parameters() -> None:
    inputs = generate_inputs(FakeRequest('{"max_tokens": 3, "id": "7"}', input_ids=[1, 2]))
    assert inputs.token_ids == [1, 2] and inputs.params.max_tokens == 3


@pytest.mark.parametrize(
    ("request_inputs", "message"),
    [
        ({}, "text_input: required (or input_ids)"),
        ({"text_input": "a", "input_ids": [1]}, "input_ids: give text_input or input_ids, not both"),
        ({"text_input": b"\xff"}, "text_input: must be UTF-8 text"),
        ({"input_ids": [-1]}, "input_ids: token ids must be in [0, 2147483647], got -1"),
        ({"input_ids": [1.5]}, "input_ids: must be integer token ids, got float64"),
        ({"text_input": "a", "stream": True, "exclude_input_in_output": False}, STREAMED_PROMPT_REFUSED),
        (
            {"text_input": "a", "sampling_parameters": '{"top_p": 2}'},
            "sampling_parameters.top_p: must be in (0, 1], got 2.0",
        ),
        ({"text_input": "a", "sampling_parameters": "[1]"}, "sampling_parameters: must be a JSON object"),
        (
            {"input_ids": [1], "apply_chat_template": True},
            "apply_chat_template: renders text_input; input_ids are sent as they are",
        ),
    ],
)
def test_a_bad_input_is_named_in_the_error(request_inputs: dict, message: str) -> None:
    assert error_text(FakeRequest(**request_inputs)) == message


def test_a_bad_request_parameter_is_named_as_a_parameter() -> None:
    assert error_text(FakeRequest('{"max_tokens": 0}', text_input="a")).startswith("parameters.max_tokens: ")


def test_the_engine_field_is_named_as_the_request_input() -> None:
    assert describe(InvalidParameterError("prompt_token_ids", "too long")) == "input_ids: too long"
