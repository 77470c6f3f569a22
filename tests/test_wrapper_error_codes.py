"""The dspark_generate wrapper gives a forwarded error back with the code of its kind (BLS keeps only
the message): client errors INVALID_ARG, server faults INTERNAL or UNAVAILABLE."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from dspark.config import REPO_ROOT


@pytest.fixture(scope="module")
def wrapper() -> types.ModuleType:
    """model_repository/dspark_generate/1/model.py, imported beside a stand-in for Triton's utils."""
    path = REPO_ROOT / "model_repository" / "dspark_generate" / "1" / "model.py"
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
    try:
        spec = importlib.util.spec_from_file_location("dspark_generate_model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["triton_python_backend_utils"]
        else:
            sys.modules["triton_python_backend_utils"] = saved
    return module


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("sampling_parameters: invalid JSON: Expecting value", "INVALID_ARG"),
        ("sampling_parameters.top_p: must be in (0, 1], got 2.0", "INVALID_ARG"),
        ("parameters.max_tokens: must be >= 1, got 0", "INVALID_ARG"),
        ("input_ids: token ids must be in [0, 2147483647], got -1", "INVALID_ARG"),
        ("text_input: must not be empty", "INVALID_ARG"),
        ("stop_token_ids: token ids must be integers in [0, 49152), got 49152", "INVALID_ARG"),
        ("exclude_input_in_output: must be true (or absent) when streaming", "INVALID_ARG"),
        ("cancel_request_id: no request in flight with id 'x'", "NOT_FOUND"),
        ("request cancelled", "CANCELLED"),
        ("engine is not running: RuntimeError('boom')", "UNAVAILABLE"),
        ("model is shutting down", "UNAVAILABLE"),
        ("Stub process 'dspark_0_0' is not healthy.", "UNAVAILABLE"),
        ("engine error: the sampling distribution is not finite (NaN or inf logits)", "INTERNAL"),
        ("internal error: number too small to fit in target type", "INTERNAL"),
        ("[request id: 7] something the server did", "INTERNAL"),
    ],
)
def test_a_forwarded_error_keeps_the_code_of_its_kind(wrapper, message, code) -> None:
    assert wrapper.error_code_name(message) == code
