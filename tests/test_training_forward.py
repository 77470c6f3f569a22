"""Training computes exactly what serving computes: the dense target pass equals the paged forward,
dense generation equals the engine's greedy decoding, and the packed training block forward equals
the drafter's inference path (KV injection + block pass) for the same weights and inputs, with one drafter
layer or two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark import LLM, EngineConfig, SamplingParams
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.loader import load_target_model
from dspark.sequence import Sequence
from dspark.spec.draft_checkpoint import load_drafter
from dspark.spec.proposer import DSparkProposer
from dspark.training.dense import target_pass
from dspark.training.draft_forward import block_hidden, confidence_logits
from dspark.training.generate import generate_batch

PAGE = 4
SEQUENCE = [3, 4, 5, 1, 6, 2, 7, 7, 3, 1, 4, 4, 5, 6, 2, 3, 1, 7, 6, 5, 2, 4]
ANCHORS = [1, 6, 11, 17]


def _paged_forward(model, tokens: list[int], capture: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    pages = -(-len(tokens) // PAGE)
    cache = PagedKVCache(cfg.num_layers, pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    batch = AttentionBatch.build([list(range(pages))], [0], [len(tokens)], PAGE, True, torch.device("cpu"))
    hidden, features = model(torch.tensor(tokens), torch.arange(len(tokens)), batch, cache, capture)
    return model.compute_logits(hidden), features


def test_dense_target_pass_equals_the_paged_forward(tiny_target_dir) -> None:
    model = load_target_model(tiny_target_dir)
    short = SEQUENCE[:9]
    padded = torch.tensor([SEQUENCE, short + [0] * (len(SEQUENCE) - len(short))])
    hidden, features = target_pass(model, padded, [1, 0])
    for row, tokens in enumerate((SEQUENCE, short)):
        logits, paged_features = _paged_forward(model, tokens, [1, 0])
        n = len(tokens)
        torch.testing.assert_close(model.compute_logits(hidden[row, :n]), logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[row, :n], paged_features, atol=1e-5, rtol=1e-5)


def test_dense_generation_equals_the_engines_greedy_decoding(tiny_target_dir) -> None:
    model = load_target_model(tiny_target_dir)
    prompts = [[3, 4, 5], [6, 1], [2, 2, 3, 4, 5, 6, 7]]
    dense = generate_batch(model, prompts, 12, [0.0] * len(prompts), [], None)
    llm = LLM(EngineConfig(model=str(tiny_target_dir), spec_mode="off", num_kv_pages=64, kv_page_size=PAGE))
    engine = llm.generate(params=SamplingParams(max_tokens=12, ignore_eos=True), prompt_token_ids=prompts)
    assert dense == [o.token_ids for o in engine]


def _inference_block(drafter, model, features: torch.Tensor, anchor: int) -> tuple[DSparkProposer, Sequence]:
    """A proposer whose draft cache holds the context before `anchor`, and a sequence anchored there."""
    embedding, lm_head = model.embed_tokens.weight, model.lm_head.weight
    proposer = DSparkProposer(drafter, embedding, lm_head, num_pages=16, page_size=PAGE)
    pages = list(range(-(-(anchor + drafter.config.block_size) // PAGE)))
    slots = torch.tensor([pages[i // PAGE] * PAGE + i % PAGE for i in range(anchor)])
    proposer.inject(features[:anchor], torch.arange(anchor), slots)
    seq = Sequence("r", 0, SEQUENCE[: anchor + 1], SamplingParams(), None)
    seq.num_cached, seq.pages = anchor, pages
    return proposer, seq


@pytest.mark.parametrize("drafter_dir", ["tiny_drafter_dir", "two_layer_drafter_dir", "anchor_drafter_dir"])
def test_training_block_forward_equals_the_inference_block_pass(
    tiny_target_dir, drafter_dir, request
) -> None:
    model = load_target_model(tiny_target_dir)
    drafter = load_drafter(request.getfixturevalue(drafter_dir), torch.float32, "cpu")
    block_size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    tokens = torch.tensor([SEQUENCE])
    _, features = target_pass(model, tokens, drafter.config.target_layer_ids)
    trained = block_hidden(drafter, model.embed_tokens.weight, features, tokens, torch.tensor([ANCHORS]))
    for j, anchor in enumerate(ANCHORS):
        proposer, seq = _inference_block(drafter, model, features[0], anchor)
        block = torch.tensor([SEQUENCE[anchor]] + [mask_id] * (block_size - 1))
        batch = AttentionBatch.build([seq.pages], [anchor], [block_size], PAGE, False, torch.device("cpu"))
        positions = torch.arange(anchor, anchor + block_size)
        heads = drafter.block_pass(
            F.embedding(block, model.embed_tokens.weight),
            positions,
            batch,
            proposer.cache,
            model.lm_head.weight,
            anchor_rows=proposer._anchor_rows(positions, batch),
        )
        torch.testing.assert_close(trained[0, j], heads.hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            F.linear(trained[0, j], model.lm_head.weight), heads.base_logits[0], atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize("drafter_dir", ["tiny_drafter_dir", "two_layer_drafter_dir", "anchor_drafter_dir"])
def test_training_heads_reproduce_the_proposers_drafts_and_confidences(
    tiny_target_dir, drafter_dir, request
) -> None:
    model = load_target_model(tiny_target_dir)
    drafter = load_drafter(request.getfixturevalue(drafter_dir), torch.float32, "cpu")
    tokens = torch.tensor([SEQUENCE])
    _, features = target_pass(model, tokens, drafter.config.target_layer_ids)
    hidden = block_hidden(drafter, model.embed_tokens.weight, features, tokens, torch.tensor([ANCHORS]))[0]
    for j, anchor in enumerate(ANCHORS):
        proposer, seq = _inference_block(drafter, model, features[0], anchor)
        proposal = proposer.propose([seq])
        previous = torch.tensor([SEQUENCE[anchor]])
        for k in range(drafter.config.block_size):
            markov = drafter.markov_features(previous)
            base = F.linear(hidden[j, k : k + 1], model.lm_head.weight)
            chosen = drafter.corrected_logits(base, markov).argmax(-1)
            confidence = torch.sigmoid(confidence_logits(drafter, hidden[j, k : k + 1], markov))
            assert int(chosen) == int(proposal.tokens[0, k])
            torch.testing.assert_close(confidence, proposal.confidences[0, k : k + 1], atol=1e-5, rtol=1e-5)
            previous = chosen
