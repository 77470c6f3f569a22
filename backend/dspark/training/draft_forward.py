"""The drafter's training forward: many blocks per sequence at once, over dense context keys/values.

It computes what `Drafter.inject_context` + `Drafter.block_pass` compute at inference, for every anchor
of a batch in one pass. Block j of a sequence is [anchor_j, mask, ..., mask] at positions
anchor_j .. anchor_j + block_size - 1; its queries see the whole of block j (non-causal) and the context
positions < anchor_j, whose keys/values come from the target's features. Blocks of one sequence are
packed side by side and kept apart by the attention mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import ops
from dspark.runner.models.llama import DecoderLayer
from dspark.spec.drafter import Drafter
from dspark.training.dense import attend, layer_forward


def block_inputs(
    drafter: Drafter, token_ids: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tokens and positions: token_ids [B, T], anchors [B, A] -> ([B, A * block_size],
    [B, A * block_size])."""
    block_size = drafter.config.block_size
    block = torch.full((*anchors.shape, block_size), drafter.config.mask_token_id, device=anchors.device)
    block[..., 0] = token_ids.gather(1, anchors)
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return block.flatten(1), positions.flatten(1)


def block_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Which keys each block query sees: [B, 1, A * block_size, context_len + A * block_size] bool.

    Keys are the context positions 0 .. context_len - 1 followed by the packed blocks.
    """
    b, a = anchors.shape
    query_anchor = anchors.repeat_interleave(block_size, dim=1)
    context = torch.arange(context_len, device=anchors.device)[None, None, :] < query_anchor[:, :, None]
    block_id = torch.arange(a, device=anchors.device).repeat_interleave(block_size)
    same_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
    return torch.cat([context, same_block], dim=-1)[:, None]


def context_kv(
    drafter: Drafter, layer: DecoderLayer, context: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV injection of one drafter layer, as `Drafter.inject_context` does it.

    context: [B, T, hidden] = hidden_norm(fc(features)); positions: [B, T].
    Returns k, v [B, kv_heads, T, head_dim].
    """
    attn = layer.self_attn
    b, t, _ = context.shape
    d = drafter.config.head_dim
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    k, v = F.linear(context, attn.qkv_proj.weight[q_size:]).split([kv_size, kv_size], dim=-1)
    k = attn.k_norm(k.reshape(-1, d))[0].view(b * t, attn.num_kv_heads, d)
    k, _ = ops.rotary(k, k, positions.reshape(-1), drafter.cos_sin)
    return (
        k.view(b, t, attn.num_kv_heads, d).transpose(1, 2),
        v.reshape(b, t, attn.num_kv_heads, d).transpose(1, 2),
    )


def block_hidden(
    drafter: Drafter,
    embedding: torch.Tensor,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """Final normed drafter states of every block: [B, A, block_size, hidden].

    embedding: the target's [vocab, hidden]; features: [B, T, len(target_layer_ids) * hidden] target
    features of every position; token_ids: [B, T]; anchors: [B, A].
    """
    cfg = drafter.config
    b, t = token_ids.shape
    ids, positions = block_inputs(drafter, token_ids, anchors)
    mask = block_mask(anchors, cfg.block_size, t)
    context, _ = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))
    context_positions = torch.arange(t, device=token_ids.device).expand(b, t)
    x = F.embedding(ids, embedding).to(drafter.fc.weight.dtype)
    if drafter.anchor_fc is not None:
        # Each block's inputs get its anchor's context row: the position before the anchor, the last one
        # whose target features the block sees (an anchor is never position 0: it follows the prompt).
        before = context.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, context.shape[-1]))
        x = x + drafter.anchor_fc(before).repeat_interleave(cfg.block_size, dim=1)
    residual: torch.Tensor | None = None
    scale = cfg.head_dim**-0.5
    for layer in drafter.layers:
        ctx_k, ctx_v = context_kv(drafter, layer, context, context_positions)

        def block_attend(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            ctx_k: torch.Tensor = ctx_k,
            ctx_v: torch.Tensor = ctx_v,
        ) -> torch.Tensor:
            keys = torch.cat([ctx_k.to(k.dtype), k], dim=2)
            values = torch.cat([ctx_v.to(v.dtype), v], dim=2)
            return attend(q, keys, values, scale, mask=mask)

        x, residual = layer_forward(layer, x, residual, positions, drafter.cos_sin, block_attend)
    hidden, _ = drafter.norm(x, residual)
    return hidden.view(b, anchors.shape[1], cfg.block_size, -1)


def confidence_logits(drafter: Drafter, hidden: torch.Tensor, markov: torch.Tensor | None) -> torch.Tensor:
    """w · [h_k ; W1[x_{k-1}]] + b, the confidence head before its sigmoid and temperature: [...]."""
    if drafter.confidence is None:
        raise ValueError("draft_model: this drafter has no confidence head")
    return drafter.confidence_logit(hidden, markov)
