"""config.pbtxt is rendered from EngineConfig: one source of truth for every engine knob."""

from __future__ import annotations

import re

from dspark.config import EngineConfig, field_names
from dspark.serving.triton_config import (
    DEFAULT_INSTANCES,
    DEFAULT_MODEL_REPOSITORY,
    INPUTS,
    OUTPUTS,
    field_docs,
    render_config_pbtxt,
)

CHECKED_IN = DEFAULT_MODEL_REPOSITORY / "dspark" / "config.pbtxt"


def parameters(pbtxt: str) -> dict[str, str]:
    pairs = re.findall(r'key: "(\w+)"\n\s*value: \{ string_value: "((?:[^"\\]|\\.)*)" \}', pbtxt)
    return {key: value.replace('\\"', '"').replace("\\\\", "\\") for key, value in pairs}


def test_checked_in_config_pbtxt_equals_the_render_of_the_defaults():
    assert CHECKED_IN.read_text() == render_config_pbtxt(), "run: python -m dspark.serving.triton_config"


def test_every_engine_field_is_a_documented_parameter():
    docs = field_docs()
    assert list(parameters(CHECKED_IN.read_text())) == field_names()
    for name in field_names():
        assert docs.get(name), f"{name} has no comment in config.py"
        assert f"# {docs[name].split()[0]}" in CHECKED_IN.read_text()


def test_rendered_parameters_parse_back_to_the_same_config():
    custom = EngineConfig(spec_mode="static", num_kv_pages=64, enable_metrics=False, model='/m/"odd"')
    for config in (EngineConfig(), custom):
        assert EngineConfig.from_parameters(parameters(render_config_pbtxt(config))) == config


def test_model_is_a_decoupled_python_backend_owning_its_devices():
    text = render_config_pbtxt(name="llm")
    assert 'name: "llm"' in text
    assert 'backend: "python"' in text
    assert "max_batch_size: 0" in text
    assert re.search(r"model_transaction_policy \{\s*decoupled: true\s*\}", text)
    assert re.search(rf"kind: KIND_MODEL\s*count: {DEFAULT_INSTANCES}\b", text)
    assert re.search(r"kind: KIND_MODEL\s*count: 2\b", render_config_pbtxt(instances=2))


def test_interface_uses_the_vllm_backend_names_plus_tokens_and_speculation():
    inputs = {t["name"]: t["data_type"] for t in INPUTS}
    outputs = {t["name"]: t["data_type"] for t in OUTPUTS}
    assert inputs["text_input"] == inputs["sampling_parameters"] == "TYPE_STRING"
    for flag in (
        "stream",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_spec_stats",
        "return_logprobs",
        "return_cumulative_logprob",
    ):
        assert inputs[flag] == "TYPE_BOOL"
    assert inputs["input_ids"] == "TYPE_INT64"
    assert set(outputs) == {
        "text_output",
        "output_ids",
        "finish_reason",
        "num_input_tokens",
        "num_output_tokens",
        "spec_stats",
        "logprobs",
        "cumulative_logprob",
    }
    assert outputs["logprobs"] == "TYPE_STRING"
    assert outputs["cumulative_logprob"] == "TYPE_FP32"
    assert all(t.get("optional") for t in INPUTS)
