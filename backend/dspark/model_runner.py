"""ModelRunner: runs this rank's target shard over one step's packed windows.

The driver builds a `TargetStep` (plain tensors, cheap to broadcast) once per step; every rank turns
it into the same AttentionBatch and runs the same forward, so ranks never plan anything themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.attention_batch import AttentionBatch
from dspark.config import EngineConfig
from dspark.kv_cache import PagedKVCache
from dspark.models.hf_config import ModelConfig
from dspark.models.llama import CausalLM
from dspark.models.loader import load_target_model


@dataclass
class TargetStep:
    """One target forward: packed tokens and where each window sits in its request's pages.

    token_ids, positions: [num_tokens] int64; window_starts / window_lens / pages: per window;
    logit_rows: [num_logit_rows] packed rows whose logits the driver needs; capture_layers: target
    layers whose outputs feed the drafter.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    window_starts: list[int]
    window_lens: list[int]
    pages: list[list[int]]
    logit_rows: torch.Tensor
    capture_layers: tuple[int, ...]


@dataclass
class TargetResult:
    """What the driver gets back: logits [num_logit_rows, vocab] fp32 on CPU, captured features
    [num_tokens, len(capture_layers) * hidden] on the device (or None), and each token's cache slot."""

    logits: torch.Tensor
    features: torch.Tensor | None
    slots: torch.Tensor


class ModelRunner:
    """Owns the target shard and its KV cache on one device."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device

    @classmethod
    def create(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> ModelRunner:
        """Load the whole target and allocate its KV cache (tensor_parallel_size 1)."""
        model = load_target_model(config.model_path, dtype=dtype, device=device)
        cfg = model.config
        cache = PagedKVCache(
            cfg.num_layers,
            config.num_kv_pages,
            config.kv_page_size,
            model.num_local_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        return cls(model, cache, device)

    @property
    def model_config(self) -> ModelConfig:
        """The target's architecture."""
        return self.model.config

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full (embedding, LM head) weights [vocab, hidden], which the drafter shares."""
        return self.model.embed_tokens.weight, self.model.lm_head.weight

    @torch.inference_mode()
    def run(self, step: TargetStep) -> TargetResult:
        """Forward the step's windows; logits only at `logit_rows`."""
        batch = AttentionBatch.build(
            step.pages, step.window_starts, step.window_lens, self.cache.page_size, True, self.device
        )
        hidden, features = self.model(
            step.token_ids.to(self.device),
            step.positions.to(self.device),
            batch,
            self.cache,
            step.capture_layers,
        )
        logits = self.model.compute_logits(hidden[step.logit_rows.to(self.device)])
        return TargetResult(logits.cpu(), features, batch.slots)

    def close(self) -> None:
        """Nothing to release for a single-process runner."""


def create_runner(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> ModelRunner:
    """The runner for this config: in-process for one rank."""
    if config.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: only 1 is supported by this build")
    return ModelRunner.create(config, device, dtype)
