"""The Llama family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) over paged KV caches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark.kernels import ops
from dspark.parallel.distributed import SINGLE, TensorParallel
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.hf_config import ModelConfig
from dspark.runner.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    rotary_cos_sin,
)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, writing its keys/values into a paged cache."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = d
        self.scale = d**-0.5
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
            bias=cfg.qkv_bias,
            tp=tp,
            shard_names=["q", "k", "v"],
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False, tp=tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q = q.reshape(n, self.num_heads, d)
        k = k.reshape(n, self.num_kv_heads, d)
        v = v.reshape(n, self.num_kv_heads, d)
        q = ops.rotary_store_kv(
            q,
            k,
            v,
            positions,
            cos_sin,
            k_cache,
            v_cache,
            batch.slots,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 1e-6,
            batch.host_rotation,
        )
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.cu_seqlens_q,
            batch.kv_lens,
            self.scale,
            batch.causal,
            batch.host_windows,
        )
        return self.o_proj(out.reshape(n, self.num_heads * d))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=False, tp=tp, shard_names=["gate", "up"]
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]."""
        return self.down_proj(self.gate_up_proj.forward_silu_mul(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual stream is carried separately and fused into norms."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual); their sum is the layer's output hidden state."""
        h, residual = self.input_layernorm(x, residual)
        if residual is None:
            residual = x
        h = self.self_attn(h, positions, batch, kv[0], kv[1], cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """A Llama-family causal LM: embeddings, decoder layers, final norm, (tied or untied) LM head."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=cfg.tie_word_embeddings)
        self.register_buffer(
            "cos_sin",
            rotary_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: PagedKVCache,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run packed windows through the decoder.

        input_ids, positions: [num_tokens]. Returns (final normed hidden [num_tokens, hidden],
        hidden states output by the `capture_layers` concatenated [num_tokens, len * hidden] or None).
        """
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        captured: list[torch.Tensor] = []
        wanted = set(capture_layers)
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, batch, kv_cache.layer(index), self.cos_sin)
            if index in wanted:
                captured.append(x + residual)
        x, _ = self.norm(x, residual)
        if not captured:
            return x, None
        by_layer = dict(zip(sorted(wanted), captured, strict=True))
        return x, torch.cat([by_layer[i] for i in capture_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab] logits, fp32 (else in the model's dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden] (the drafter shares these embeddings)."""
        return self.embed_tokens(token_ids)
