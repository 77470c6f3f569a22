"""Prompt lookup (`dspark.spec.lookup`): the copied drafts are the tokens after the latest earlier
occurrence of a request's last 3 (else 2) tokens, found alike as the request grows; an engine that
copies drafts keeps greedy output plain, mixes copied and drafted blocks in one step, and skips the
drafter pass when every request copied. (Sampling with copies: `test_losslessness.py`.)"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import emulated_graphs_config, tiny_engine_config, use_emulated_graphs

from dspark import LLM, SamplingParams
from dspark.sequence import Sequence
from dspark.spec import lookup as lookup_module
from dspark.spec.drafts import Drafts
from dspark.spec.lookup import LOOKUP_CONFIDENCE, MAX_NGRAM, MIN_NGRAM, PromptLookup
from dspark.spec.proposer import DSparkProposer


class _Seq:
    """What PromptLookup reads of a request: its tokens (weakly referenced, as a Sequence is)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def _reference(tokens: list[int], count: int) -> list[int]:
    """The rule, walked in Python: the longest of the last MAX_NGRAM..MIN_NGRAM tokens that occurred
    before (ending before the last token), its latest occurrence, what followed it."""
    n = len(tokens)
    for size in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if n <= size:
            continue
        key = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):
            if tokens[start : start + size] == key:
                return tokens[start + size : start + size + count]
    return []


@pytest.mark.parametrize("vocab", [3, 8, 1 << 20])
def test_copies_follow_the_latest_longest_earlier_match_as_the_request_grows(vocab: int) -> None:
    """Random requests, grown a few tokens at a time (the lookup keeps their tokens between calls):
    every answer is the reference rule's. Large ids make byte patterns that straddle two tokens, which
    must not count as matches."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    lookup = PromptLookup()
    found = 0
    for _ in range(40):
        seq = _Seq([rng.randrange(vocab) for _ in range(rng.randrange(1, 6))])
        for _ in range(25):
            count = rng.randrange(0, 6)
            got = lookup.drafts(seq, count)  # type: ignore[arg-type]
            assert got == _reference(seq.token_ids, count), f"seed={seed}"
            found += bool(got)
            seq.token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
    if vocab <= 8:
        assert found > 100, f"seed={seed}"  # small vocabularies repeat: most calls find one


def test_a_match_straddling_two_tokens_is_not_a_match() -> None:
    """Ids whose bytes, read across token boundaries, spell the last two tokens' bytes: no copy from
    there; an aligned occurrence before them is still found."""
    k1, k2 = 0x04030201, 0x08070605  # little-endian bytes 01 02 03 04 | 05 06 07 08
    straddle = [0x030201AA, 0x07060504, 0x00000008]  # AA 01 02 03 | 04 05 06 07 | 08 00 00 00
    assert PromptLookup().drafts(_Seq([*straddle, k1, k2]), 3) == []  # type: ignore[arg-type]
    seq = _Seq([k1, k2, 9, *straddle, k1, k2])
    assert PromptLookup().drafts(seq, 3) == [9, *straddle[:2]] == _reference(seq.token_ids, 3)  # type: ignore[arg-type]


def test_nothing_is_copied_without_an_earlier_occurrence() -> None:
    lookup = PromptLookup()
    assert lookup.drafts(_Seq([5]), 3) == []  # type: ignore[arg-type]
    assert lookup.drafts(_Seq([1, 2, 3, 4]), 3) == []  # type: ignore[arg-type]
    assert lookup.drafts(_Seq([1, 2, 9, 1, 2]), 0) == []  # type: ignore[arg-type]
    assert lookup.drafts(_Seq([1, 2, 9, 1, 2]), 3) == [9, 1, 2]  # type: ignore[arg-type]
    # The 3-gram's occurrence wins over a later 2-gram one.
    assert lookup.drafts(_Seq([7, 1, 2, 4, 5, 1, 2, 6, 7, 1, 2]), 2) == [4, 5]  # type: ignore[arg-type]


class _Spy:
    """Counts, per propose() call, how many requests got copies and whether the drafter ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[int, int, bool]] = []  # (requests, copied, drafter ran)
        real_propose, real_drafted = DSparkProposer.propose, DSparkProposer._propose_drafted
        spy = self

        def propose(proposer, seqs, length=None, copies=True):  # noqa: ANN001, ANN202
            spy._ran = False
            drafts = real_propose(proposer, seqs, length, copies)
            copied = sum(bool(proposer.lookup.drafts(s, 1)) for s in seqs) if proposer.lookup else 0
            spy.steps.append((len(seqs), copied, spy._ran))
            return drafts

        def drafted(proposer, seqs, length):  # noqa: ANN001, ANN202
            spy._ran = True
            return real_drafted(proposer, seqs, length)

        monkeypatch.setattr(DSparkProposer, "propose", propose)
        monkeypatch.setattr(DSparkProposer, "_propose_drafted", drafted)


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_greedy_output_is_plain_with_copied_and_drafted_blocks_in_one_step(
    tiny_target_dir, tiny_drafter_dir, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny target (8 tokens) repeats itself, so copies are frequent: greedy output equals plain
    decoding's; some steps mix copied and drafted blocks, and a step in which every request copied
    runs no drafter pass (one in which none did runs it)."""
    rng = random.Random()
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 16))] for _ in range(6)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(tiny_engine_config(tiny_target_dir, spec_mode="off", device="cpu"))
    expected = [o.token_ids for o in plain.generate(params=params, prompt_token_ids=prompts)]
    spy = _Spy(monkeypatch)
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode=mode, device="cpu"))
    assert llm.engine.config.prompt_lookup  # on by default
    assert [o.token_ids for o in llm.generate(params=params, prompt_token_ids=prompts)] == expected
    assert any(0 < copied < requests and ran for requests, copied, ran in spy.steps)
    assert all(ran for requests, copied, ran in spy.steps if copied < requests)
    assert not any(ran for requests, copied, ran in spy.steps if copied == requests)
    # A request alone whose prompt holds 5 followed by every token and ends in 5: whatever its first
    # token, its first block is copied, with no drafter pass.
    spy.steps.clear()
    every = [t for k in range(8) for t in (5, k)] + [5]
    llm.generate(params=SamplingParams(max_tokens=4, ignore_eos=True), prompt_token_ids=[every])
    assert spy.steps and spy.steps[0][1:] == (1, False)


def test_copied_drafts_carry_their_confidence_and_length(tiny_target_dir, tiny_drafter_dir) -> None:
    """Copied blocks: the copied tokens, LOOKUP_CONFIDENCE for each and zeros past their length (copies
    shorter than the block); a sampling request's draft distribution is one-hot at each copy; a
    drafted row keeps the drafter's block."""
    llm = LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static", device="cpu"))
    proposer = llm.engine.proposer
    assert isinstance(proposer, DSparkProposer) and proposer.lookup is not None
    block = proposer.block_size
    greedy, sampled = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0)
    seqs = [
        Sequence(f"r{i}", i, [4, 6, 1, 2, 4, 6], params, None) for i, params in enumerate((greedy, sampled))
    ]
    inner = Drafts(torch.tensor([[7] * block]), torch.full((1, block), 0.5), [None], None)
    drafts = proposer._with_copies([*seqs, seqs[0]], [[1, 2], [1, 2, 4], []], [2], inner)
    assert drafts.tokens[:2, :3].tolist() == [[1, 2, 0], [1, 2, 4]]
    assert drafts.tokens[2].tolist() == [7] * block and drafts.confidences[2].eq(0.5).all()
    assert drafts.lengths.tolist() == [2, 3, block]
    assert drafts.confidences[0, :2].eq(LOOKUP_CONFIDENCE).all() and drafts.confidences[0, 2:].eq(0).all()
    assert drafts.probs[0] is None and drafts.probs[2] is None
    probs = drafts.probs[1]
    assert probs is not None and probs.shape == (block, proposer.lm_head.shape[0])
    assert probs[0, 1] == probs[1, 2] == probs[2, 4] == 1 and float(probs.sum()) == 3.0


def test_the_early_stop_shortens_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied block ends where its survival (LOOKUP_CONFIDENCE to the k) would fall below the stop."""

    class _Stub:
        stop_survival = 0.5

    assert DSparkProposer._copy_count(_Stub(), 7) == 2  # type: ignore[arg-type]
    _Stub.stop_survival = 0.0
    assert DSparkProposer._copy_count(_Stub(), 7) == 7  # type: ignore[arg-type]
    assert lookup_module.LOOKUP_CONFIDENCE**2 >= 0.5 > lookup_module.LOOKUP_CONFIDENCE**3


def test_static_verifies_no_position_past_a_short_copy() -> None:
    """`static` verifies each request's cap, lowered to what it drafted: a copy shorter than the block
    leaves no undrafted position in its window (for a sampling request such a position has no draft
    law to accept by)."""
    from dspark.spec.verify_policy import StaticPolicy

    drafts = Drafts(
        torch.tensor([[4, 0, 0], [1, 2, 3]]), torch.zeros(2, 3), [None, None], torch.tensor([1, 3])
    )
    plan = StaticPolicy().plan(drafts, [3, 2], None)  # type: ignore[arg-type]
    assert plan.verify_lens == (1, 2)


def test_windows_laid_out_before_drafting_take_no_copies(
    tiny_target_dir, tiny_drafter_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`static` on (emulated) CUDA graphs lays a step's windows out before drafting; a step with sampling
    requests then drafts apart (`InStepDrafts.pack`) and must draft whole drafter blocks: a copy shorter
    than its window would leave a window position with no draft law to accept by."""
    llm = LLM(emulated_graphs_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static"))
    use_emulated_graphs(llm.engine)
    copied, asked = [], []
    real_copies, real_propose = DSparkProposer._with_copies, DSparkProposer.propose

    def with_copies(*args):  # noqa: ANN002, ANN202
        copied.append(True)
        return real_copies(*args)

    def propose(proposer, seqs, length=None, copies=True):  # noqa: ANN001, ANN202
        asked.append(copies)
        return real_propose(proposer, seqs, length, copies)

    monkeypatch.setattr(DSparkProposer, "_with_copies", with_copies)
    monkeypatch.setattr(DSparkProposer, "propose", propose)
    every = [t for k in range(8) for t in (5, k)] + [5]  # a copy is found whatever comes next
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    llm.generate(params=params, prompt_token_ids=[every] * 3)
    assert asked and not any(asked) and not copied
