"""dspark_generate: a non-decoupled wrapper that returns a whole completion in one response.

It forwards each request to the decoupled `dspark` model through BLS with streaming off (so dspark
answers once, FINAL on that response) and hands that response back: tritonclient.http `infer()`
and /v2/models/dspark_generate/infer work. The request id is passed on, so a running completion can
be cancelled by sending dspark a request with `cancel_request_id` set to that id. Request
parameters travel as a `sampling_parameters` input (BLS parameters cannot hold a float such as a
temperature); dspark reads the input over the parameters anyway, so with one the parameters are dropped.

Errors keep their kind: a BLS response's error arrives with its message only (its code() is always
INTERNAL), so the code is read back from the message: dspark names the request field that is wrong
("sampling_parameters.top_p: ...") for every client error, which becomes INVALID_ARG (HTTP 400);
cancellations, unavailability and everything else keep CANCELLED, UNAVAILABLE, INTERNAL.
"""

from __future__ import annotations

import dataclasses
import json
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.sampling_params import SamplingParams
from dspark.serving.triton_config import INPUTS, OUTPUTS, add_missing_io, parameters_from_model_config

FORWARDED_INPUTS = [tensor for tensor in INPUTS if tensor["name"] != "stream"]
OUTPUT_NAMES = [tensor["name"] for tensor in OUTPUTS]
# A client error's message starts with the field it names: an input, a request parameter
# ("parameters.top_p") or a sampling parameter checked against the model ("stop_token_ids").
CLIENT_ERROR_FIELDS = (
    frozenset(tensor["name"] for tensor in INPUTS)
    | {"parameters"}
    | {f.name for f in dataclasses.fields(SamplingParams)}
)
# Server-side messages (dspark's and Triton's) and the codes they keep.
SERVER_MESSAGE_CODES = (
    ("request cancelled", "CANCELLED"),
    ("engine is not running", "UNAVAILABLE"),
    ("model is shutting down", "UNAVAILABLE"),
    ("is not healthy", "UNAVAILABLE"),
)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        add_missing_io(auto_complete_model_config, FORWARDED_INPUTS, OUTPUTS)
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict) -> None:
        parameters = parameters_from_model_config(json.loads(args["model_config"]))
        self._target = parameters.get("target_model", "dspark")

    def execute(self, requests: list) -> list:
        return [self._complete(request) for request in requests]

    def _complete(self, request):
        try:
            return self._forward(request)
        except Exception as exc:  # one request's failure is its own error response
            pb_utils.Logger.log_error(f"dspark_generate: request failed: {traceback.format_exc()}")
            return _error_response(f"internal error: {exc}")

    def _forward(self, request):
        inputs, from_parameters = _sampling_input(request)
        forwarded = pb_utils.InferenceRequest(
            model_name=self._target,
            inputs=inputs,
            requested_output_names=list(request.requested_output_names()) or OUTPUT_NAMES,
            request_id=request.request_id(),
        )
        outputs: dict[str, object] = {}
        for response in forwarded.exec(decoupled=True):
            if response.has_error():
                message = response.error().message()
                if from_parameters and message.startswith("sampling_parameters"):
                    message = message.replace("sampling_parameters", "parameters", 1)  # what the client sent
                return _error_response(message)
            for tensor in response.output_tensors():
                outputs[tensor.name()] = tensor
        return pb_utils.InferenceResponse(output_tensors=list(outputs.values()))


def _sampling_input(request) -> tuple[list, bool]:
    """The inputs to forward, with the request parameters (if any, and no `sampling_parameters` input)
    turned into a `sampling_parameters` input; and whether they were."""
    inputs = request.inputs()
    text = request.parameters() or "{}"
    if not json.loads(text) or pb_utils.get_input_tensor_by_name(request, "sampling_parameters") is not None:
        return inputs, False
    tensor = pb_utils.Tensor("sampling_parameters", np.array([text.encode()], dtype=np.object_))
    return [*inputs, tensor], True


def error_code_name(message: str) -> str:
    """The TritonError code name a forwarded error message stands for (see the module docstring)."""
    field = message.partition(":")[0]
    if field.split(".", 1)[0] in CLIENT_ERROR_FIELDS:
        unknown_id = field == "cancel_request_id" and "no request in flight" in message
        return "NOT_FOUND" if unknown_id else "INVALID_ARG"
    return next((code for marker, code in SERVER_MESSAGE_CODES if marker in message), "INTERNAL")


def _error_response(message: str):
    code = getattr(pb_utils.TritonError, error_code_name(message))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
