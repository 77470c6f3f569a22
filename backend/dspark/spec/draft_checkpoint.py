"""Read and write drafters in the DSpark draft checkpoint format (and read DFlash), and make fresh ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.runner.models.hf_config import ModelConfig
from dspark.runner.models.loader import checkpoint_tensors
from dspark.spec.draft_config import DraftConfig, evenly_spread_layer_ids
from dspark.spec.drafter import Drafter

# Checkpoint name -> our parameter. Embedding/LM-head copies are ignored: the target's are used.
_HEADS = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "confidence.weight",
    "confidence_head.proj.bias": "confidence.bias",
}
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_PREFIXES = ("embed_tokens.", "lm_head.")


def load_drafter(draft_dir: str | Path, dtype: torch.dtype, device: str | torch.device) -> Drafter:
    """Build a Drafter from a DSpark (or DFlash) draft checkpoint directory."""
    draft_dir = Path(draft_dir)
    cfg = DraftConfig.load(draft_dir)
    with torch.device(device):
        drafter = Drafter(cfg)
    params = dict(drafter.named_parameters())
    loaded: set[str] = set()
    for name, tensor in checkpoint_tensors(draft_dir):
        name = name.removeprefix("model.")
        if name.startswith(_IGNORED_PREFIXES):
            continue
        target, shard = _map_name(name)
        if target not in params:
            raise KeyError(f"draft_model: checkpoint tensor {name!r} has no place in the drafter")
        param = params[target]
        full = tensor.to(device=device, dtype=torch.float32)
        loader = getattr(param, "load", None)
        if loader is not None:
            loader(param, full, shard)
        else:
            param.data.copy_(full)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"draft_model: checkpoint lacks {missing[:5]}")
    drafter = drafter.to(dtype).eval()
    drafter.cos_sin = drafter.cos_sin.float()
    drafter.confidence_temperatures = drafter.confidence_temperatures.float()
    return drafter.requires_grad_(False)


def save_drafter(drafter: Drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `drafter` as a DSpark draft checkpoint: config.json + model.safetensors."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    tensors: dict[str, torch.Tensor] = {}
    for name, param in drafter.named_parameters():
        for ours, theirs in _HEADS.items():
            if name == theirs:
                name = ours
        tensor = param.detach().to("cpu", dtype)
        if ".qkv_proj." in name:
            d = cfg.head_dim
            sizes = [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
            for piece, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes), strict=True):
                tensors[name.replace("qkv_proj", piece)] = part.contiguous()
        elif ".gate_up_proj." in name:
            for piece, part in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                tensors[name.replace("gate_up_proj", piece)] = part.contiguous()
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return out_dir


def fresh_draft_config(
    target: ModelConfig,
    block_size: int = 7,
    num_layers: int = 1,
    markov_rank: int = 32,
    mask_token_id: int | None = None,
    num_target_features: int = 3,
) -> DraftConfig:
    """A drafter architecture sized for `target`: same hidden size, target-style heads."""
    return DraftConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_heads,
        num_key_value_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        block_size=block_size,
        target_layer_ids=evenly_spread_layer_ids(target.num_layers, num_target_features),
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
        markov_rank=markov_rank,
        enable_confidence_head=True,
    )


def create_random_drafter(cfg: DraftConfig, seed: int = 0, std: float = 0.02) -> Drafter:
    """A randomly initialised drafter (so everything runs before a trained one exists)."""
    generator = torch.Generator().manual_seed(seed)
    drafter = Drafter(cfg)
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, std, generator=generator)
    return drafter.eval().requires_grad_(False)


def _map_name(name: str) -> tuple[str, str | None]:
    if name in _HEADS:
        return _HEADS[name], None
    for piece, (fused, shard) in _FUSED.items():
        if f".{piece}." in name:
            return name.replace(piece, fused), shard
    return name, None
