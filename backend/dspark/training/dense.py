"""Dense (non-paged) batched passes through Llama-family decoder layers, for training and data generation.

The serving path runs layers over paged KV caches; training wants whole padded batches and arbitrary
attention masks instead. These helpers drive the very same layer modules (norms, projections, rotary)
and swap only the attention: a dense scaled-dot-product attention over keys the caller provides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dspark.kernels import ops
from dspark.runner.models.llama import Attention, CausalLM, DecoderLayer

# (q [B, heads, Q, d], k [B, kv_heads, Q, d], v [B, kv_heads, Q, d]) -> [B, heads, Q, d]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def project_qkv(
    attn: Attention, h: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, values of `h` [B, Q, hidden] at `positions` [B, Q], normed and rotated as in serving.

    Returns q [B, heads, Q, d], k and v [B, kv_heads, Q, d].
    """
    b, n, _ = h.shape
    d = attn.head_dim
    q, k, v = attn.qkv_proj(h).split([attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d], -1)
    q = q.reshape(b * n, attn.num_heads, d)
    k = k.reshape(b * n, attn.num_kv_heads, d)
    v = v.reshape(b * n, attn.num_kv_heads, d)
    if attn.q_norm is not None and attn.k_norm is not None:
        q = attn.q_norm(q.reshape(-1, d))[0].view(b * n, attn.num_heads, d)
        k = attn.k_norm(k.reshape(-1, d))[0].view(b * n, attn.num_kv_heads, d)
    q, k = ops.rotary(q, k, positions.reshape(-1), cos_sin)
    # Norm weights kept in fp32 under autocast promote q and k; serving keeps them in the weights' dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    return (
        q.view(b, n, attn.num_heads, d).transpose(1, 2),
        k.view(b, n, attn.num_kv_heads, d).transpose(1, 2),
        v.view(b, n, attn.num_kv_heads, d).transpose(1, 2),
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Grouped-query attention: q [B, heads, Q, d] over k, v [B, kv_heads, K, d]; mask [B, 1, Q, K] bool
    (True: may attend). Query head h reads key head h // (heads / kv_heads), as the paged kernels do."""
    group = q.shape[1] // k.shape[1]
    # Context keys/values may arrive in another dtype than the block's (fp32 norms under autocast).
    k, v = k.to(q.dtype), v.to(q.dtype)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def layer_forward(
    layer: DecoderLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    attend_fn: AttendFn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward on [B, Q, hidden] with the attention supplied by `attend_fn`."""
    b, n, _ = x.shape
    attn = layer.self_attn
    h, residual = layer.input_layernorm(x, residual)
    if residual is None:
        residual = x
    q, k, v = project_qkv(attn, h, positions, cos_sin)
    out = attend_fn(q, k, v).transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim)
    h, residual = layer.post_attention_layernorm(attn.o_proj(out), residual)
    return layer.mlp(h), residual


def target_pass(
    model: CausalLM, token_ids: torch.Tensor, capture_layers: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal pass over right-padded sequences token_ids [B, T].

    Returns (final normed hidden [B, T, hidden], outputs of `capture_layers` concatenated in that order
    [B, T, len * hidden]), the same quantities CausalLM.forward gives the engine.
    """
    b, t = token_ids.shape
    positions = torch.arange(t, device=token_ids.device).expand(b, t)
    scale = model.layers[0].self_attn.scale
    x = model.embed(token_ids)
    residual: torch.Tensor | None = None
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        x, residual = layer_forward(
            layer, x, residual, positions, model.cos_sin, lambda q, k, v: attend(q, k, v, scale, causal=True)
        )
        if index in capture_layers:
            captured[index] = x + residual
    hidden, _ = model.norm(x, residual)
    return hidden, torch.cat([captured[i] for i in capture_layers], dim=-1)
