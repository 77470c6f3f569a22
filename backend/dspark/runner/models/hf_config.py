"""ModelConfig: the architecture facts of a Hugging Face `config.json` that the engine needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    rope_scaling: dict | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Parse a config.json dict; unsupported architectures are a clear error."""
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}.get(
                raw.get("model_type", "")
            )
        if family is None:
            raise ValueError(
                f"architectures: {archs or raw.get('model_type')} not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            torch_dtype=str(raw.get("torch_dtype", "float32")),
            rope_scaling=raw.get("rope_scaling"),
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` from a model directory."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))
