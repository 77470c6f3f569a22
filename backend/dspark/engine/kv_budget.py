"""How many KV-cache pages an engine gets when its config leaves `num_kv_pages` at 0 (sized at start).

On a GPU the cache takes a fraction of the memory left once the weights are in (`kv_cache_memory_fraction`
of what is free now, less the weights still to load), and never more than `max_num_seqs` requests of the
longest context could use: a fixed page count either starves a large GPU (requests queue for pages
while memory sits idle) or does not fit a small one. The weights are counted from the checkpoints'
configs before they load, so the cache is sized before anything is allocated; with tensor parallelism
the free memory is read on the driver's GPU (rank 0) and every rank takes that many pages of its
shard. On the CPU the cache is CPU_KV_PAGES pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dspark.config import EngineConfig
from dspark.runner.models.hf_config import ModelConfig
from dspark.spec.draft_config import DraftConfig

logger = logging.getLogger(__name__)

# Pages of an unsized cache on the CPU (32k tokens at 16 a page; host memory is shared with everything).
CPU_KV_PAGES = 2048


@dataclass(frozen=True)
class KvFootprint:
    """Bytes one tensor-parallel rank needs: the weights it holds and one KV page of every model."""

    weight_bytes: int
    page_bytes: int


def footprint(
    target: ModelConfig, drafter: DraftConfig | None, page_size: int, dtype: torch.dtype, tp_size: int
) -> KvFootprint:
    """The weights and per-page KV bytes of the rank that holds the most (rank 0: it also runs the
    drafter). Linear weights split over the ranks; embeddings, norms and the LM head are counted whole
    (an over-count only leaves more memory free)."""
    width = torch.empty((), dtype=dtype).element_size()
    hidden, head_dim = target.hidden_size, target.head_dim
    kv_heads = -(-target.num_kv_heads // tp_size)
    per_layer = hidden * head_dim * (2 * target.num_heads + 2 * target.num_kv_heads) // tp_size
    per_layer += 3 * hidden * target.intermediate_size // tp_size + 2 * hidden
    vocab = target.vocab_size * hidden * (1 if target.tie_word_embeddings else 2)
    weights = target.num_layers * per_layer + vocab + hidden  # + the final norm
    page = target.num_layers * 2 * kv_heads * head_dim * page_size
    if drafter is not None:
        d_hidden, d_head = drafter.hidden_size, drafter.head_dim
        d_layer = d_hidden * d_head * (2 * drafter.num_attention_heads + 2 * drafter.num_key_value_heads)
        d_layer += 3 * d_hidden * drafter.intermediate_size + 2 * d_hidden + 2 * d_head  # + norms
        # Its input projection from the concatenated target features, its norms, a Markov head's
        # factors and the confidence head.
        weights += drafter.num_hidden_layers * d_layer + len(drafter.target_layer_ids) * hidden * d_hidden
        rank = max(drafter.markov_rank, 0)
        weights += 2 * drafter.vocab_size * rank + 3 * d_hidden + rank + 1
        page += drafter.num_hidden_layers * 2 * drafter.num_key_value_heads * d_head * page_size
        if drafter.anchor_feature:  # its anchor projection, and a context row per cache slot
            weights += d_hidden * d_hidden
            page += d_hidden * page_size
    return KvFootprint(weights * width, page * width)


def pages_within(free_bytes: int, fraction: float, need: KvFootprint, most_pages: int) -> int:
    """Pages that `fraction` of the memory left after the weights holds, at most `most_pages`; at least
    one (the engine then says the cache is too small for a request, naming num_kv_pages)."""
    budget = int((free_bytes - need.weight_bytes) * fraction)
    return max(1, min(most_pages, budget // need.page_bytes))


def free_device_bytes(device: torch.device) -> int:
    """Bytes this process may still allocate on `device`: the driver's free memory plus what torch's
    caching allocator holds without using (an earlier engine's freed blocks)."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resolve_kv_pages(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, loads_drafter: bool
) -> EngineConfig:
    """`config` with `num_kv_pages` sized when it is 0 (unchanged otherwise). loads_drafter: the engine
    loads `draft_model` (not when speculation is off or a proposer is given to it)."""
    if config.num_kv_pages:
        return config
    if device.type != "cuda":
        return config.replace(num_kv_pages=CPU_KV_PAGES)
    target = ModelConfig.load(config.model_path)
    drafter = DraftConfig.load(config.draft_model_path) if loads_drafter else None
    need = footprint(target, drafter, config.kv_page_size, dtype, config.tensor_parallel_size)
    longest = (config.max_model_len or target.max_position_embeddings) + (
        drafter.block_size + 1 if drafter is not None else 1
    )
    most = config.max_num_seqs * -(-longest // config.kv_page_size)
    free = free_device_bytes(device)
    pages = pages_within(free, config.kv_cache_memory_fraction, need, most)
    logger.info(
        "KV cache: %d pages of %d tokens (%.1f GiB a rank; %.1f GiB free, %.1f GiB of weights)",
        pages,
        config.kv_page_size,
        pages * need.page_bytes / 2**30,
        free / 2**30,
        need.weight_bytes / 2**30,
    )
    return config.replace(num_kv_pages=pages)
