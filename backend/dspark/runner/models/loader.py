"""Load a Hugging Face target checkpoint (single or sharded safetensors) into CausalLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from dspark.parallel.distributed import SINGLE, TensorParallel
from dspark.runner.models.hf_config import ModelConfig
from dspark.runner.models.layers import rotary_cos_sin
from dspark.runner.models.llama import CausalLM

# Checkpoint piece -> (our fused parameter, shard name inside it).
_FUSED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The torch device for a config device name; `auto` is CUDA when visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is visible")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a config dtype name; `auto` is bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from `model.safetensors`, or every shard named by its index file, or else
    every *.safetensors file (other safetensors files beside model.safetensors, such as a drafter's
    draft_vocab.safetensors, hold no weights)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors in {model_dir}")
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_target_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Build the target model from a Hugging Face directory, keeping this rank's shards."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    with torch.device(device):
        model = CausalLM(cfg, tp)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in checkpoint_tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target, shard = _map_name(name)
        if target not in params:
            raise KeyError(f"model: checkpoint tensor {name!r} has no place in {cfg.family} model")
        param = params[target]
        param.load(param, tensor.to(device=device, dtype=torch.float32), shard)  # type: ignore[attr-defined]
        loaded.add(target)
    missing = {
        n for n in params if n not in loaded and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    }
    if missing:
        raise KeyError(f"model: checkpoint lacks {sorted(missing)[:5]}")
    model = model.to(dtype).eval()
    # The rotary table stays fp32 whatever the weights' dtype: positions need its precision.
    model.cos_sin = _rope(cfg, device)
    return model


def _map_name(name: str) -> tuple[str, str | None]:
    name = name.removeprefix("model.")
    for piece, fused, shard in _FUSED:
        if piece in name:
            return name.replace(piece, fused), shard
    return name, None


def _rope(cfg: ModelConfig, device: str | torch.device) -> torch.Tensor:
    return rotary_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(
        device
    )
