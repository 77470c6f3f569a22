"""A Triton request's inputs read as engine values, and an InvalidParameterError as the client's message.

The Triton adapter (model_repository/dspark/1/model.py) hands each request here and gets back a prompt,
SamplingParams and flags, or an InvalidParameterError naming the request's own input. Values are read
as Triton's vLLM backend reads them (dspark.sampling_params converts and bounds the sampling
parameters); the tensors and error texts are those of dspark.serving.triton_config's interface.

`triton_python_backend_utils` exists only inside the backend stub, so it is imported where a tensor is
looked up: this module imports anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.sampling_params import MAX_INT, InvalidParameterError, SamplingParams, parse_json_object

CANCEL_ALL = "*"  # the cancel_request_id that cancels every request in flight (dspark serve does, to stop)

RETURN_FLAGS = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_spec_stats",
    "return_logprobs",
    "return_cumulative_logprob",
)
ENGINE_FIELDS = {"prompt": "text_input", "prompt_token_ids": "input_ids"}
# Triton's vLLM backend's words (its enabled_stream client test compares them exactly).
STREAMED_PROMPT_REFUSED = (
    "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
)


@dataclass(frozen=True)
class GenerateInputs:
    """What a generation request asks of the engine, and of its responses."""

    text: str | None  # text_input, or None when the prompt is input_ids
    chat: bool  # text_input is one user turn, to render with the model's chat template
    token_ids: list[int] | None
    stream: bool
    exclude_input: bool  # leave the prompt out of a non-streamed completion's text
    params: SamplingParams
    returns: frozenset[str]  # the RETURN_FLAGS the request set


def generate_inputs(request: Any) -> GenerateInputs:
    """A generation request's inputs, checked (InvalidParameterError names the input at fault)."""
    text = string_input(request, "text_input")
    token_ids = ids_input(request)
    if text is None and token_ids is None:
        raise InvalidParameterError("text_input", "required (or input_ids)")
    if text is not None and token_ids is not None:
        raise InvalidParameterError("input_ids", "give text_input or input_ids, not both")
    chat = bool(bool_input(request, "apply_chat_template"))
    if chat and text is None:
        raise InvalidParameterError(
            "apply_chat_template", "renders text_input; input_ids are sent as they are"
        )
    stream = bool(bool_input(request, "stream"))
    exclude = bool_input(request, "exclude_input_in_output")
    if stream and exclude is False:
        raise InvalidParameterError("exclude_input_in_output", STREAMED_PROMPT_REFUSED)
    params = sampling_params(request)
    returns = frozenset(name for name in RETURN_FLAGS if bool_input(request, name))
    return GenerateInputs(text, chat, token_ids, stream, bool(exclude), params, returns)


def string_input(request: Any, name: str) -> str | None:
    """The first element of the string input `name` as text, None when the request lacks it."""
    tensor = _input_tensor(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidParameterError(name, "must be UTF-8 text") from None
    return str(value)


def bool_input(request: Any, name: str) -> bool | None:
    """The first element of the boolean input `name`, None when the request lacks it."""
    tensor = _input_tensor(request, name)
    return None if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


def ids_input(request: Any) -> list[int] | None:
    """The `input_ids` tensor as Python ints, each in [0, MAX_INT] (the vocabulary is checked later)."""
    tensor = _input_tensor(request, "input_ids")
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.dtype.kind not in "iu":
        raise InvalidParameterError("input_ids", f"must be integer token ids, got {array.dtype}")
    ids = array.reshape(-1).tolist()  # exact Python ints, whatever the integer width
    for token_id in ids:
        if not 0 <= token_id <= MAX_INT:
            raise InvalidParameterError("input_ids", f"token ids must be in [0, {MAX_INT}], got {token_id}")
    return ids


def sampling_params(request: Any) -> SamplingParams:
    """From the `sampling_parameters` JSON input, else from the request parameters (as vLLM's backend)."""
    tensor = _input_tensor(request, "sampling_parameters")
    try:
        if tensor is not None:
            return SamplingParams.from_json(string_input(request, "sampling_parameters"))
        values = parse_json_object(request.parameters() or "{}", "parameters")
        values.pop("id", None)  # the generate endpoint copies the request id into the parameters
        return SamplingParams.from_dict(values)
    except InvalidParameterError as exc:
        if exc.field in ("sampling_parameters", "parameters"):
            raise
        source = "sampling_parameters" if tensor is not None else "parameters"
        raise InvalidParameterError(f"{source}.{exc.field}", message(exc)) from None


def describe(exc: InvalidParameterError) -> str:
    """The error text, naming the request's own input rather than the engine's field."""
    # The vLLM backend's own sentence stays whole: its clients compare the text (and it names the input).
    if message(exc) == STREAMED_PROMPT_REFUSED:
        return STREAMED_PROMPT_REFUSED
    return f"{ENGINE_FIELDS.get(exc.field, exc.field)}: {message(exc)}"


def message(exc: InvalidParameterError) -> str:
    """The error's text without the field it names."""
    return str(exc).removeprefix(f"{exc.field}: ")


def _input_tensor(request: Any, name: str) -> Any:
    import triton_python_backend_utils as pb_utils  # only inside the backend stub (see the module)

    return pb_utils.get_input_tensor_by_name(request, name)
