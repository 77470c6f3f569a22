"""A reduced draft vocabulary (`spec.draft_vocab`, `draft_vocab_size`): drafts come from its tokens only,
they are the full drafter's choices restricted to them, and output stays the target's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_models import drafter_with_vocab, tiny_engine_config

from dspark import LLM, SamplingParams
from dspark.kernels import reference
from dspark.spec.draft_vocab import frequency_order, load_draft_vocab, save_draft_vocab
from dspark.spec.drafter import BlockHeads
from dspark.spec.proposer import DSparkProposer

TINY_VOCAB = 8


def test_frequency_order_puts_special_tokens_first_then_counts_then_ids() -> None:
    order = frequency_order([[5, 5, 3], [3, 5, 9, 9]], vocab_size=10, always=[7, 7, 42])
    # 7 first (always; 42 is no token), then 5 (3 times), 3 and 9 (twice: by id), then the unseen by id.
    assert order.tolist() == [7, 5, 3, 9, 0, 1, 2, 4, 6, 8]


def test_load_takes_the_first_k_sorted_and_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    assert load_draft_vocab(tmp_path, 0, 10) is None
    with pytest.raises(ValueError, match="draft_vocab_size"):
        load_draft_vocab(tmp_path, 4, 10)
    save_draft_vocab(torch.tensor([7, 5, 3, 9, 0, 1, 2, 4, 6, 8]), tmp_path)
    assert load_draft_vocab(tmp_path, 3, 10).tolist() == [3, 5, 7]
    assert load_draft_vocab(tmp_path, 10, 10) is None  # the whole vocabulary: no reduction
    assert load_draft_vocab(tmp_path, 0, 10) is None  # the file names no default size: every token
    with pytest.raises(ValueError, match="not an ordering"):
        load_draft_vocab(tmp_path, 3, 12)
    save_draft_vocab(torch.tensor([7, 5, 3, 9, 0, 1, 2, 4, 6, 8]), tmp_path, default_size=2)
    assert load_draft_vocab(tmp_path, 0, 10).tolist() == [5, 7]  # 0: the drafter's own size
    assert load_draft_vocab(tmp_path, -1, 10) is None  # -1: every token
    assert load_draft_vocab(tmp_path, 4, 10).tolist() == [3, 5, 7, 9]


def test_an_engine_asked_for_a_draft_vocabulary_its_drafter_lacks_names_the_field(
    tiny_target_dir, tiny_drafter_dir
) -> None:
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, draft_vocab_size=4))


def test_anchor_rows_give_the_markov_decode_of_logits_masked_outside_the_draft_vocabulary() -> None:
    """The GPU path's decode in draft-vocabulary indices (W1 rows of the draft tokens, then one row per
    anchor) equals the full decode over logits that are -inf outside the draft vocabulary."""
    rng = torch.Generator().manual_seed(random.randrange(2**31))
    requests, block, vocab, rank = 5, 4, 40, 6
    logits = torch.randn(requests, block, vocab, generator=rng)
    w1, w2 = torch.randn(vocab, rank, generator=rng), torch.randn(vocab, rank, generator=rng)
    anchors = torch.randint(0, vocab, (requests,), generator=rng)
    ids = torch.randperm(vocab, generator=rng)[:12].sort().values
    masked = torch.full_like(logits, float("-inf"))
    masked[..., ids] = logits[..., ids]
    expected = reference.markov_decode(masked, anchors, w1, w2)
    rows = torch.cat([w1[ids], w1[anchors]])
    anchor_rows = torch.arange(len(ids), len(ids) + requests)
    got = ids[reference.markov_decode(logits[..., ids].contiguous(), anchor_rows, rows, w2[ids])]
    assert torch.equal(got, expected)
    assert torch.isin(got, ids).all()


def test_the_gpu_decode_path_gives_the_masked_full_decode(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    """DSparkProposer._greedy_decode (what a GPU and its draft graphs run), called on the CPU: the drafts
    of a draft vocabulary equal the full drafter's Markov decode over logits masked outside it."""
    order = random.sample(range(TINY_VOCAB), TINY_VOCAB)
    draft_dir = drafter_with_vocab(tiny_drafter_dir, tmp_path, order)
    llm = LLM(tiny_engine_config(tiny_target_dir, draft_dir, draft_vocab_size=5, device="cpu"))
    proposer = llm.engine.proposer
    assert isinstance(proposer, DSparkProposer) and proposer.vocab_ids is not None
    requests, block = 6, proposer.block_size
    # Small states: the base logits nearly flat, so the Markov correction (the previous token's) decides.
    hidden = 1e-3 * torch.randn(requests, block, proposer.lm_head.shape[1])
    anchors = torch.randint(0, TINY_VOCAB, (requests,))
    heads = BlockHeads(hidden, proposer.draft_head)
    heads.project_all()
    tokens, _, _ = proposer._greedy_decode(heads, anchors)
    full = hidden @ proposer.lm_head.t()
    masked = torch.full_like(full, float("-inf"))
    masked[..., proposer.vocab_ids] = full[..., proposer.vocab_ids]
    drafter = proposer.drafter
    expected = reference.markov_decode(masked, anchors, drafter.markov_w1.weight, drafter.markov_w2.weight)
    assert torch.equal(tokens, expected), f"order={order}"
    assert torch.isin(tokens, torch.tensor(sorted(order[:5]))).all()


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_greedy_output_is_plain_and_every_draft_is_a_draft_vocabulary_token(
    tiny_target_dir, tiny_drafter_dir, tmp_path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    rng = random.Random()
    order = rng.sample(range(TINY_VOCAB), TINY_VOCAB)
    draft_dir = drafter_with_vocab(tiny_drafter_dir, tmp_path, order)
    allowed = set(order[:3])
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off", device="cpu")).generate(
        params=params, prompt_token_ids=prompts
    )
    drafted: list[int] = []
    real_propose = DSparkProposer.propose

    def spying(self, seqs, length=None):  # noqa: ANN001, ANN202
        drafts = real_propose(self, seqs, length)
        lengths = drafts.lengths.tolist() if drafts.lengths is not None else [self.block_size] * len(seqs)
        for row, n in zip(drafts.tokens.tolist(), lengths, strict=True):
            drafted.extend(row[:n])
        return drafts

    monkeypatch.setattr(DSparkProposer, "propose", spying)
    llm = LLM(
        tiny_engine_config(
            tiny_target_dir,
            draft_dir,
            spec_mode=mode,
            draft_vocab_size=3,
            device="cpu",
            draft_stop_survival=0.0,
            prompt_lookup=False,  # the drafter's drafts, not copies of the request's tokens
        )
    )
    out = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain], f"order={order}"
    assert drafted and set(drafted) <= allowed, f"order={order}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_output_is_plain_with_a_draft_vocabulary_through_cuda_graphs(
    tiny_target_dir, tiny_drafter_dir, tmp_path
) -> None:
    order = random.sample(range(TINY_VOCAB), TINY_VOCAB)
    draft_dir = drafter_with_vocab(tiny_drafter_dir, tmp_path, order)
    rng = random.Random()
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    base = tiny_engine_config(tiny_target_dir, draft_dir, device="cuda", dtype="float32")
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    llm = LLM(base.replace(draft_vocab_size=3))
    out = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain], f"order={order}"
    assert llm.engine.total_spec_stats.drafted_tokens > 0
