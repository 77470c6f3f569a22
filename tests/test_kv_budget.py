"""The KV cache sized at start (num_kv_pages 0): the weights and page bytes it counts against what the
engine really allocates, the page arithmetic, and the sized cache on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from dspark import LLM, EngineConfig, SamplingParams
from dspark.engine.kv_budget import (
    CPU_KV_PAGES,
    KvFootprint,
    footprint,
    free_device_bytes,
    pages_within,
    resolve_kv_pages,
)
from dspark.runner.models.hf_config import ModelConfig
from dspark.spec.draft_config import DraftConfig

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("speculative", [False, True])
def test_the_footprint_covers_the_loaded_weights_and_is_exact_per_page(
    smollm2_dir, smollm2_drafter_dir, speculative
) -> None:
    """Counted from the configs before anything loads: at least the weights the engine holds (not far
    above), and exactly the bytes one page takes in the target's and the drafter's caches."""
    pages = 5
    config = EngineConfig(
        model=str(smollm2_dir),
        draft_model=str(smollm2_drafter_dir),
        spec_mode="static" if speculative else "off",
        num_kv_pages=pages,
        max_num_seqs=2,
        max_model_len=64,
        device="cpu",
    )
    engine = LLM(config).engine
    cache = engine.runner.cache
    loaded = _bytes(p for p in engine.runner.model.parameters())
    cached = _bytes([cache.k, cache.v])
    if speculative:
        drafter = engine.proposer.drafter
        loaded += _bytes(p for name, p in drafter.named_parameters() if "embed" not in name)
        cached += _bytes([engine.proposer.cache.k, engine.proposer.cache.v])
    counted = footprint(
        ModelConfig.load(smollm2_dir),
        DraftConfig.load(smollm2_drafter_dir) if speculative else None,
        config.kv_page_size,
        torch.float32,
        tp_size=1,
    )
    assert counted.page_bytes * pages == cached
    assert loaded <= counted.weight_bytes <= 1.25 * loaded, (loaded, counted.weight_bytes)
    engine.close()


def test_pages_within_takes_the_fraction_of_what_the_weights_leave() -> None:
    gib = 1 << 30
    need = KvFootprint(weight_bytes=10 * gib, page_bytes=1 << 20)
    assert pages_within(110 * gib, 0.5, need, most_pages=1 << 30) == 50 * 1024
    assert pages_within(110 * gib, 0.5, need, most_pages=300) == 300
    assert pages_within(5 * gib, 0.8, need, most_pages=300) == 1  # the engine then names num_kv_pages
    for _ in range(20):
        free, fraction = random.randrange(1, 200) * gib, random.uniform(0.05, 1.0)
        pages = pages_within(free, fraction, need, most_pages=1 << 30)
        assert pages * need.page_bytes <= max(need.page_bytes, (free - need.weight_bytes) * fraction)
        assert (pages + 1) * need.page_bytes > (free - need.weight_bytes) * fraction


def test_a_set_page_count_stays_and_the_cpu_gets_its_default(smollm2_dir) -> None:
    set_pages = EngineConfig(model=str(smollm2_dir), num_kv_pages=77)
    assert resolve_kv_pages(set_pages, torch.device("cpu"), torch.float32, True) is set_pages
    sized = resolve_kv_pages(EngineConfig(model=str(smollm2_dir)), torch.device("cpu"), torch.float32, True)
    assert sized.num_kv_pages == CPU_KV_PAGES
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=0.0)
    with pytest.raises(ValueError, match="num_kv_pages"):
        EngineConfig(num_kv_pages=-1)


@pytest.mark.gpu
@pytest.mark.big_gpu_memory  # takes its share of the GPU's free memory: alone, not beside the workers
@gpu
def test_the_gpu_cache_is_sized_from_free_memory_and_serves(smollm2_dir, smollm2_drafter_dir) -> None:
    """On the GPU the default cache takes its fraction of the free memory (or all the pages its
    requests can use), and the engine captures its graphs and decodes with it."""
    device = torch.device("cuda")
    config = EngineConfig(
        model=str(smollm2_dir), draft_model=str(smollm2_drafter_dir), spec_mode="static", device="cuda"
    )
    free_before = free_device_bytes(device)
    llm = LLM(config)
    pages = llm.engine.config.num_kv_pages
    need = footprint(
        ModelConfig.load(smollm2_dir), DraftConfig.load(smollm2_drafter_dir), 16, torch.bfloat16, 1
    )
    longest = ModelConfig.load(smollm2_dir).max_position_embeddings + llm.engine.limits.block_size + 1
    most = config.max_num_seqs * -(-longest // config.kv_page_size)
    # Measured again at start: another test's memory may have been collected in between.
    expected = pages_within(free_before, config.kv_cache_memory_fraction, need, most)
    assert abs(pages - expected) <= 0.02 * expected, (pages, expected)
    assert llm.engine.load().kv_pages_total == pages
    assert pages * need.page_bytes <= 1.02 * config.kv_cache_memory_fraction * free_before
    outputs = llm.generate(
        params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=[[1, 2, 3]] * 64
    )
    assert all(len(o.token_ids) == 16 for o in outputs)
    assert free_device_bytes(device) > 0.1 * free_before  # left for activations and graphs
    llm.engine.close()


def test_an_anchor_feature_counts_its_projection_and_a_context_row_per_slot(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    """A drafter with an anchor feature holds one more hidden x hidden projection and, in its proposer,
    one context row per cache slot (`DSparkProposer.context_rows`)."""
    import dataclasses

    target, drafter = ModelConfig.load(tiny_target_dir), DraftConfig.load(tiny_drafter_dir)
    plain = footprint(target, drafter, 4, torch.float32, tp_size=1)
    anchored = footprint(target, dataclasses.replace(drafter, anchor_feature=True), 4, torch.float32, 1)
    width, hidden = 4, drafter.hidden_size
    assert anchored.page_bytes - plain.page_bytes == hidden * 4 * width
    assert anchored.weight_bytes - plain.weight_bytes == hidden * hidden * width
