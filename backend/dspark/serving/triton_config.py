"""The Triton side of the model: its I/O tensors and its config.pbtxt, rendered from EngineConfig.

EngineConfig is the one source of truth for the engine knobs: their names, defaults and the comment
above each field become the documented `parameters` of `model_repository/dspark/config.pbtxt`.
Regenerate the checked-in file with `python -m dspark.serving.triton_config`.
"""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

from dspark import config as config_module
from dspark.config import REPO_ROOT, EngineConfig

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_INSTANCES = 4  # backend stubs sharing the engine (the instance_group count)

# Request tensors, in the model-config JSON form that `auto_complete_config` adds. The names and
# semantics follow Triton's vLLM backend; input_ids, apply_chat_template, return_spec_stats and
# cancel_request_id are ours.
INPUTS: list[dict] = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "apply_chat_template", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_spec_stats", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_cumulative_logprob", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "cancel_request_id", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
]

OUTPUTS: list[dict] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "spec_stats", "data_type": "TYPE_STRING", "dims": [-1]},
    # As the vLLM backend's: per token {token_id: {logprob, rank, decoded_token}} as JSON ("null" when
    # sampling_parameters.logprobs is unset), and the chosen tokens' summed log probability.
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
]

_HEADER = """\
# The DSpark model: a decoupled Triton Python backend streaming tokens as they are committed.
# GENERATED from dspark.config.EngineConfig by dspark.serving.triton_config; edit EngineConfig, then run
#   python -m dspark.serving.triton_config
# Inputs and outputs are set by model.py's auto_complete_config (dspark.serving.triton_config.INPUTS/OUTPUTS);
# GET /v2/models/{name}/config shows the complete configuration.
"""

_BODY = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{
  decoupled: true
}}
# The engine batches requests itself (continuous batching) and places itself on the devices
# (KIND_MODEL), as Triton's LLM backends do. Each instance is a backend stub process that takes in
# requests and sends responses; all of a model's instances share one engine process (one copy of the
# weights, one KV cache). One stub's interpreter lock bounds the requests and responses a second it
# handles, so more instances serve more concurrent streams (engine_process must be true for more than 1).
instance_group [
  {{
    kind: KIND_MODEL
    count: {instances}
  }}
]
"""

_FIELD_LINE = re.compile(r"^    (\w+): [^=]+= ")
_COMMENT_LINE = re.compile(r"^    # ?(.*)$")


def field_docs() -> dict[str, str]:
    """The comment block above each EngineConfig field in config.py, by field name."""
    names = {f.name for f in fields(EngineConfig)}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(config_module).splitlines():
        comment = _COMMENT_LINE.match(line)
        if comment:
            pending.append(comment.group(1).rstrip())
            continue
        field = _FIELD_LINE.match(line)
        if field and field.group(1) in names:
            docs[field.group(1)] = " ".join(pending)
        pending = []
    return docs


def parameter_value(value: object) -> str:
    """The string form of a config value in `parameters` (what EngineConfig.from_parameters reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_config_pbtxt(
    config: EngineConfig | None = None, name: str = "dspark", instances: int = DEFAULT_INSTANCES
) -> str:
    """config.pbtxt for the dspark model, every EngineConfig field a documented `parameters` entry, with
    `instances` backend stubs sharing its engine."""
    config = config if config is not None else EngineConfig()
    docs = field_docs()
    parts = [_HEADER.format(name=name), _BODY.format(name=name, instances=instances)]
    parts.append("# Engine parameters (dspark.EngineConfig). Values are strings; booleans are true/false.\n")
    for f in fields(EngineConfig):
        comment = "\n".join(f"# {line}" for line in _wrap(docs.get(f.name, ""), 100))
        parts.append(
            f"{comment}\nparameters: {{\n"
            f'  key: "{f.name}"\n'
            f'  value: {{ string_value: "{_quote(parameter_value(getattr(config, f.name)))}" }}\n'
            "}\n"
        )
    return "\n".join(parts)


def add_missing_io(auto_complete_model_config, inputs: list[dict], outputs: list[dict]):  # noqa: ANN001, ANN201
    """Add to a model's auto-complete config every input and output it does not declare itself."""
    config = auto_complete_model_config.as_dict()
    have_inputs = {tensor["name"] for tensor in config["input"]}
    have_outputs = {tensor["name"] for tensor in config["output"]}
    for tensor in inputs:
        if tensor["name"] not in have_inputs:
            auto_complete_model_config.add_input(tensor)
    for tensor in outputs:
        if tensor["name"] not in have_outputs:
            auto_complete_model_config.add_output(tensor)
    return auto_complete_model_config


def parameters_from_model_config(model_config: dict) -> dict[str, str]:
    """The `parameters` of a model-config JSON (as Triton hands it to initialize) as plain strings."""
    return {key: entry["string_value"] for key, entry in model_config.get("parameters", {}).items()}


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def main(argv: list[str] | None = None) -> int:
    """Write the default dspark config.pbtxt (the checked-in file)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_MODEL_REPOSITORY / "dspark" / "config.pbtxt",
        help="file to write (default: the repository's model_repository/dspark/config.pbtxt)",
    )
    args = parser.parse_args(argv)
    args.out.write_text(render_config_pbtxt())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
