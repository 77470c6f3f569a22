"""DraftConfig: the drafter's architecture, read from a DSpark or DFlash draft checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.runner.models.hf_config import ModelConfig

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"


@dataclass
class DraftConfig:
    """A DSpark drafter: a few Qwen3-style layers fed by target-layer features, plus Markov and
    confidence heads. DFlash checkpoints are the special case with neither head."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    # Per-block-position calibration temperatures of the confidence head (fitted offline).
    confidence_temperatures: list[float] = field(default_factory=list)
    # The anchor's context row (the projected target features of the position before the block) added
    # to every block position's input through `anchor_fc`, as EAGLE feeds its drafter the target's state
    # directly rather than only through attention (the proposer keeps a row per cache slot).
    anchor_feature: bool = False
    architectures: list[str] = field(default_factory=lambda: [DSPARK_ARCHITECTURE])

    def __post_init__(self) -> None:
        if not self.confidence_temperatures:
            self.confidence_temperatures = [1.0] * self.block_size
        if len(self.confidence_temperatures) != self.block_size:
            raise ValueError("confidence_temperatures: need one per block position")
        if self.markov_head_type != "vanilla":
            raise ValueError(f"markov_head_type: only 'vanilla' is supported, got {self.markov_head_type!r}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: at least one target layer is required")

    @property
    def layer_config(self) -> ModelConfig:
        """The drafter layers as a Qwen3-style decoder config (q/k norm, no bias)."""
        return ModelConfig(
            family="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            qkv_bias=False,
            qk_norm=True,
            torch_dtype="float32",
        )

    @classmethod
    def from_dict(cls, raw: dict) -> DraftConfig:
        """Parse the DSpark format, or the DFlash format (keys under `dflash_config`, no heads)."""
        nested = raw.get("dflash_config") or {}
        num_heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            vocab_size=raw["vocab_size"],
            block_size=raw["block_size"],
            target_layer_ids=list(raw.get("target_layer_ids") or nested["target_layer_ids"]),
            mask_token_id=raw.get("mask_token_id", nested.get("mask_token_id")),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            markov_rank=raw.get("markov_rank", 0),
            markov_head_type=raw.get("markov_head_type", "vanilla"),
            enable_confidence_head=bool(raw.get("enable_confidence_head", False)),
            confidence_temperatures=list(raw.get("confidence_temperatures") or []),
            anchor_feature=bool(raw.get("anchor_feature", False)),
            architectures=list(raw.get("architectures") or [DSPARK_ARCHITECTURE]),
        )

    @classmethod
    def load(cls, draft_dir: str | Path) -> DraftConfig:
        """Read `config.json` from a draft checkpoint directory."""
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"draft_model: no config.json in {draft_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict:
        """The DSpark-format config.json content."""
        out = asdict(self)
        out["model_type"] = "dspark"
        return out


def evenly_spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layer ids spread from layer 1 to layer L - 3 (the DFlash/DSpark convention)."""
    if count == 1:
        return [num_target_layers // 2]
    first, last = 1, max(num_target_layers - 3, 1)
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]
