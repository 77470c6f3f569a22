"""Batched generation by the target over a dense KV cache: the self-distillation responses.

Prompts are left-padded into one batch; padded keys are masked out and every row keeps its own
positions, so each row computes what it would alone. Rows stop at EOS or after `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.runner.models.llama import CausalLM
from dspark.training.dense import attend, layer_forward


class DenseKVCache:
    """Keys and values of every target layer for a batch: [layers, B, kv_heads, max_len, head_dim]."""

    def __init__(self, model: CausalLM, batch: int, max_len: int) -> None:
        cfg = model.config
        weight = model.embed_tokens.weight
        shape = (cfg.num_layers, batch, model.num_local_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        # key_valid[b, j]: column j of row b holds a real token (not left padding, already written).
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=weight.device)


@torch.inference_mode()
def forward_cached(
    model: CausalLM, cache: DenseKVCache, token_ids: torch.Tensor, positions: torch.Tensor, start: int
) -> torch.Tensor:
    """Run token_ids [B, n] (cache columns start..start+n) and return final hidden [B, n, hidden].

    Each query sees the valid keys at or before its own column; a padded query also sees itself, so no
    row of the softmax is empty.
    """
    b, n = token_ids.shape
    end = start + n
    columns = torch.arange(end, device=token_ids.device)
    query_columns = torch.arange(start, end, device=token_ids.device)
    causal = columns[None, :] <= query_columns[:, None]
    itself = columns[None, :] == query_columns[:, None]
    mask = ((causal[None] & cache.key_valid[:, None, :end]) | itself[None])[:, None]
    scale = model.layers[0].self_attn.scale
    x = model.embed(token_ids)
    residual: torch.Tensor | None = None
    for index, layer in enumerate(model.layers):

        def cached_attend(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int = index
        ) -> torch.Tensor:
            cache.k[index, :, :, start:end] = k
            cache.v[index, :, :, start:end] = v
            return attend(q, cache.k[index, :, :, :end], cache.v[index, :, :, :end], scale, mask=mask)

        x, residual = layer_forward(layer, x, residual, positions, model.cos_sin, cached_attend)
    hidden, _ = model.norm(x, residual)
    return hidden


@torch.inference_mode()
def generate_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperatures: Sequence[float],
    eos_token_ids: Sequence[int],
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Responses of the target to `prompts`, greedy where the row's temperature is 0, else sampled.

    A response ends with its EOS token when one is produced.
    """
    device = model.embed_tokens.weight.device
    b = len(prompts)
    longest = max(len(p) for p in prompts)
    cache = DenseKVCache(model, b, longest + max_new_tokens)
    ids = torch.zeros(b, longest, dtype=torch.long, device=device)
    positions = torch.zeros(b, longest, dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    for row, prompt in enumerate(prompts):
        pad = longest - len(prompt)
        ids[row, pad:] = torch.tensor(prompt, device=device)
        positions[row, pad:] = torch.arange(len(prompt), device=device)
        cache.key_valid[row, pad:longest] = True
    temps = torch.tensor(temperatures, dtype=torch.float32, device=device)
    eos = torch.tensor(list(eos_token_ids) or [-1], device=device)
    hidden = forward_cached(model, cache, ids, positions, 0)[:, -1]
    out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    num_new = torch.zeros(b, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        token = _choose(model.compute_logits(hidden), temps, generator)
        out[:, step] = token
        num_new += (~done).long()
        done |= torch.isin(token, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        column = longest + step
        cache.key_valid[:, column] = True
        hidden = forward_cached(model, cache, token[:, None], (lengths + step)[:, None], column)[:, -1]
    return [out[row, : int(num_new[row])].tolist() for row in range(b)]


def _choose(logits: torch.Tensor, temps: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Argmax for rows at temperature 0, a sample from softmax(logits / T) elsewhere: [B, vocab] -> [B]."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = temps > 0
    if not bool(sampled_rows.any()):
        return greedy
    probs = torch.softmax(logits / temps.clamp_min(1e-6)[:, None], dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(sampled_rows, sampled, greedy)
