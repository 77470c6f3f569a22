"""Draft checkpoints: the DSpark format with its heads, the DFlash format without them, fresh drafters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.model_runner import ModelRunner
from dspark.spec.draft_checkpoint import load_drafter
from dspark.spec.draft_config import DraftConfig
from dspark.spec.profile import profile_sps_table


def _to_dflash(dspark_dir, out_dir) -> None:
    """Rewrite a DSpark checkpoint as DFlash would ship it: no Markov/confidence heads, keys nested."""
    out_dir.mkdir()
    raw = json.loads((dspark_dir / "config.json").read_text())
    nested = {"mask_token_id": raw.pop("mask_token_id"), "target_layer_ids": raw.pop("target_layer_ids")}
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_temperatures"):
        raw.pop(key)
    raw |= {"architectures": ["DFlashDraftModel"], "dflash_config": nested}
    (out_dir / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(dspark_dir / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith(("markov_head.", "confidence_head."))}
    kept["embed_tokens.weight"] = torch.randn(8, 32)  # DFlash ships its own copy; it must be ignored
    save_file(kept, str(out_dir / "model.safetensors"))


def test_dflash_checkpoint_loads_without_heads_and_stays_lossless(
    tiny_target_dir, tiny_drafter_dir, tmp_path
):
    dflash_dir = tmp_path / "dflash"
    _to_dflash(tiny_drafter_dir, dflash_dir)
    cfg = DraftConfig.load(dflash_dir)
    assert cfg.markov_rank == 0 and not cfg.enable_confidence_head
    drafter = load_drafter(dflash_dir, torch.float32, "cpu")
    assert drafter.markov_w1 is None and drafter.confidence is None
    prompts = [[3, 4, 5], [6, 1]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = EngineConfig(
        model=str(tiny_target_dir), num_kv_pages=64, kv_page_size=4, adaptive_speculation=False
    )
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    spec = LLM(base.replace(draft_model=str(dflash_dir), spec_mode="compact")).generate(
        params=params, prompt_token_ids=prompts
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].spec_stats.verified_tokens > 0


def test_dspark_checkpoint_keeps_heads_and_temperatures(tiny_drafter_dir) -> None:
    drafter = load_drafter(tiny_drafter_dir, torch.float32, "cpu")
    assert drafter.markov_w1 is not None and drafter.confidence is not None
    assert drafter.confidence_temperatures.tolist() == [1.0] * drafter.config.block_size


def test_profiled_sps_table_covers_powers_of_two(tiny_target_dir) -> None:
    config = EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=128, kv_page_size=4)
    table = profile_sps_table(config, max_tokens=16, repeats=2)
    assert [p.tokens for p in table.points] == [1, 2, 4, 8, 16]
    assert all(p.steps_per_second > 0 for p in table.points)


def test_engine_profiles_its_own_sps_table_at_start_and_stays_lossless(
    tiny_target_dir, tiny_drafter_dir, monkeypatch
) -> None:
    base = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(tiny_drafter_dir),
        num_kv_pages=128,
        kv_page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        spec_mode="compact",  # the mode whose planner reads the table
        adaptive_speculation=False,
    )
    # The profiled steps are the engine's own: they hand the drafter its target layers (the same graphs,
    # KV injection included), not a plain forward.
    profiled: list[tuple[int, ...]] = []
    forward = ModelRunner.forward

    def recording(runner, step):
        profiled.append(tuple(step.capture_layers))
        return forward(runner, step)

    monkeypatch.setattr(ModelRunner, "forward", recording)
    llm = LLM(base.replace(sps_table="profile"))
    monkeypatch.setattr(ModelRunner, "forward", forward)
    layers = tuple(llm.engine.proposer.target_layer_ids)
    assert profiled and layers and set(profiled) == {layers}
    table = llm.engine.planner.sps
    # 4 requests x (block 4 + 1) = 20 tokens at most per decoding step: profiled up to 16.
    assert [p.tokens for p in table.points] == [1, 2, 4, 8, 16]
    assert all(p.steps_per_second > 0 for p in table.points)
    assert llm.engine.allocator.num_used == 0  # profiling borrowed the cache, not its pages
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    spec = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_profiling_in_a_cache_too_small_for_it_is_a_clear_error(tiny_target_dir, tiny_drafter_dir) -> None:
    config = EngineConfig(
        model=str(tiny_target_dir),
        draft_model=str(tiny_drafter_dir),
        spec_mode="compact",
        sps_table="profile",
        num_kv_pages=8,
        kv_page_size=4,
    )
    with pytest.raises(ValueError, match="num_kv_pages"):
        LLM(config)
