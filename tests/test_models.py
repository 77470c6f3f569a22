"""Our Llama/Qwen2/Qwen3 implementations match the transformers reference on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from dspark.runner.models.dense import dense_logits
from dspark.runner.models.loader import load_target_model

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def _save_tiny(family: str, tied: bool, path) -> object:
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(torch.seed() % 2**31)
    model = getattr(transformers, model_cls)(config).eval()
    if family == "qwen2":
        with torch.no_grad():  # Qwen2's qkv biases start at zero; make them matter.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(family: str, tied: bool, tmp_path) -> None:
    reference = _save_tiny(family, tied, tmp_path)
    ours = load_target_model(tmp_path, dtype=torch.float32)
    token_ids = torch.randint(0, 97, (37,)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    got = dense_logits(ours, token_ids, page_size=8)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_bfloat16_logits_stay_close_to_float32(tmp_path) -> None:
    _save_tiny("llama", True, tmp_path)
    token_ids = torch.randint(0, 97, (20,)).tolist()
    full = dense_logits(load_target_model(tmp_path, dtype=torch.float32), token_ids)
    half = dense_logits(load_target_model(tmp_path, dtype=torch.bfloat16), token_ids)
    assert (half - full).norm() / full.norm() < 3e-2
