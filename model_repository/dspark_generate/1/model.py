"""dspark_generate: a non-decoupled wrapper that returns a whole completion in one response.

It forwards each request to the decoupled `dspark` model through BLS with streaming off (so dspark
answers once, FINAL on that response) and hands that response back: tritonclient.http `infer()`
and /v2/models/dspark_generate/infer work. The request id is passed on, so a running completion can
be cancelled by sending dspark a request with `cancel_request_id` set to that id.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from dspark.triton_config import INPUTS, OUTPUTS, add_missing_io, parameters_from_model_config

FORWARDED_INPUTS = [tensor for tensor in INPUTS if tensor["name"] != "stream"]
OUTPUT_NAMES = [tensor["name"] for tensor in OUTPUTS]


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
        forwarded = pb_utils.InferenceRequest(
            model_name=self._target,
            inputs=request.inputs(),
            requested_output_names=list(request.requested_output_names()) or OUTPUT_NAMES,
            request_id=request.request_id(),
            parameters=json.loads(request.parameters() or "{}"),
        )
        outputs: dict[str, object] = {}
        for response in forwarded.exec(decoupled=True):
            if response.has_error():
                return pb_utils.InferenceResponse(error=response.error())
            for tensor in response.output_tensors():
                outputs[tensor.name()] = tensor
        return pb_utils.InferenceResponse(output_tensors=list(outputs.values()))
