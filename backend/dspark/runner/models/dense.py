"""dense_logits: run a whole token sequence through a model in one window (tests and tools)."""

from __future__ import annotations

import torch

from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.llama import CausalLM


@torch.inference_mode()
def dense_logits(model: CausalLM, token_ids: list[int], page_size: int = 16) -> torch.Tensor:
    """Logits at every position of one sequence: [len(token_ids), vocab], fp32.

    Uses a scratch paged cache exactly big enough, so it exercises the same attention path as serving.
    """
    device = model.cos_sin.device
    cfg = model.config
    num_pages = -(-len(token_ids) // page_size)
    cache = PagedKVCache(
        cfg.num_layers,
        num_pages,
        page_size,
        model.num_local_kv_heads,
        cfg.head_dim,
        model.embed_tokens.weight.dtype,
        device,
    )
    batch = AttentionBatch.build([list(range(num_pages))], [0], [len(token_ids)], page_size, True, device)
    ids = torch.tensor(token_ids, device=device)
    hidden, _ = model(ids, torch.arange(len(token_ids), device=device), batch, cache)
    return model.compute_logits(hidden)
