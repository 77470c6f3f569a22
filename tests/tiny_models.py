"""Tiny real checkpoints written on the fly: a Llama-family target with a word-level tokenizer, and
DSpark drafters for it. Small enough that a test can enumerate the target's exact distribution."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.runner.models.hf_config import ModelConfig
from dspark.spec.draft_checkpoint import create_random_drafter, fresh_draft_config, save_drafter
from dspark.spec.gate import SpeculationGate


def write_tiny_target(
    path: Path,
    vocab_size: int = 8,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    logit_scale: float = 1.5,
) -> Path:
    """A random Llama checkpoint (untied head scaled by `logit_scale`: clear greedy choices, yet sampling
    far from deterministic)
    plus a word-level tokenizer whose tokens are w0, w1, ... (w0 doubles as EOS)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, hidden * 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {
        "model.embed_tokens.weight": rand(vocab_size, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(vocab_size, hidden, std=logit_scale / hidden**0.5),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w0"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path


def write_tiny_drafter(
    target_dir: Path,
    path: Path,
    block_size: int = 4,
    seed: int = 0,
    std: float = 0.3,
    num_layers: int = 1,
    anchor_feature: bool = False,
) -> Path:
    """A randomly initialised DSpark drafter (Markov + confidence heads; an anchor feature if asked)
    for a tiny target."""
    target = ModelConfig.load(target_dir)
    cfg = fresh_draft_config(
        target,
        block_size=block_size,
        num_layers=num_layers,
        markov_rank=4,
        mask_token_id=1,
        num_target_features=2,
    )
    cfg = dataclasses.replace(cfg, anchor_feature=anchor_feature)
    save_drafter(create_random_drafter(cfg, seed=seed, std=std), path, dtype=torch.float32)
    return path


def tiny_engine_config(target_dir: Path, draft_dir: Path | None = None, **changes: object) -> EngineConfig:
    """An engine over the tiny checkpoints with room for the tests' batches, drafting on every step (the
    laws the tests measure are speculation's, not the adaptive gate's), one step at a time (the tests
    of a step's mechanics count steps and their windows; tests/test_decode_burst.py asks for bursts)."""
    base = EngineConfig(
        model=str(target_dir),
        draft_model=str(draft_dir or ""),
        num_kv_pages=96,
        kv_page_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        adaptive_speculation=False,
        decode_burst=1,
    )
    return base.replace(**changes)


def decaying_sps_table(directory: Path) -> str:
    """An SPS table file (in `directory`) under which verifying long windows does not always pay: the
    planner reads the confidences, plans get ragged and `compact` drafts apart, stopping early."""
    path = directory / "decaying-sps.json"
    points = [{"tokens": t, "steps_per_second": 100.0 / (1 + 0.08 * t)} for t in (1, 2, 4, 8, 16, 32, 64)]
    path.write_text(json.dumps({"version": 1, "points": points}))
    return str(path)


def emulated_graphs_config(
    target_dir: Path, draft_dir: Path | None = None, **changes: object
) -> EngineConfig:
    """The tiny engine whose steps fit emulated graphs of 32 tokens and 4 requests (pages of 4), drafting
    every step (`use_emulated_graphs`)."""
    config = tiny_engine_config(
        target_dir, draft_dir, num_kv_pages=256, max_num_seqs=4, max_num_batched_tokens=32
    )
    return config.replace(**changes)


def gpu_graphs_config(target_dir: Path, draft_dir: Path | None = None, **changes: object) -> EngineConfig:
    """`tiny_engine_config` on a CUDA GPU in fp32, its steps replayed from real CUDA graphs (up to 64
    tokens, 8 requests)."""
    config = tiny_engine_config(target_dir, draft_dir, device="cuda", dtype="float32", num_kv_pages=256)
    return config.replace(**{"max_num_seqs": 8, **changes})


def use_emulated_graphs(
    engine: LLMEngine, tokens: int = 32, requests: int = 4, capture: bool = True
) -> LLMEngine:
    """Make the engine's target steps (and its drafter's blocks, `static` ones inside the target step)
    replay emulated CUDA graphs: the GPU path's buffers, padding and tiers, run eagerly on any device."""
    from dspark.runner.cuda_graphs import CudaGraphs

    runner = engine.runner
    runner.use_graphs(CudaGraphs(runner.model, runner.cache, runner.device, tokens, requests, emulate=True))
    if engine.proposer is not None:
        engine.proposer.use_graphs(engine.config.max_num_seqs, max_pages=64, emulate=True)
    if capture:
        engine._capture_graphs()
    return engine


def drafter_with_vocab(draft_dir: Path, out_dir: Path, order: list[int]) -> Path:
    """A copy of a drafter whose draft_vocab.safetensors holds `order` (`spec.draft_vocab`)."""
    from dspark.spec.draft_vocab import save_draft_vocab

    copy = out_dir / "drafter-with-vocab"
    shutil.copytree(draft_dir, copy)
    save_draft_vocab(torch.tensor(order), copy)
    return copy


class RandomLengthGate(SpeculationGate):
    """A speculation gate that picks a random draft length every step: plain and drafting steps of every
    length follow (and, with overlap scheduling, go ahead of) each other in every order."""

    def __init__(self, block_size: int, rng: random.Random) -> None:
        super().__init__(block_size)
        self._rng = rng

    def draft_length(self, num_requests: int, draining=None) -> int:
        """A random one of the gate's lengths."""
        return self._rng.choice(self.lengths)
