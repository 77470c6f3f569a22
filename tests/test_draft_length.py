"""A step's draft length (the gate's choice, `SpeculationGate.draft_length`): an eager block drafts only
that many positions, the same drafts as the whole block's first ones, and an engine held at any length
gives plain decoding's greedy tokens while verifying no more drafts a step than the length."""

from __future__ import annotations

import random

import pytest
from tiny_models import emulated_graphs_config, tiny_engine_config, use_emulated_graphs

from dspark import LLM, SamplingParams
from dspark.spec.drafter import BlockHeads


def _random_prompts(count: int) -> list[list[int]]:
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    return [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 20))] for _ in range(count)]


def _held_at(llm: LLM, length: int) -> LLM:
    """The engine with its gate's choice fixed at `length` (0: plain steps)."""
    assert llm.engine.gate is not None
    llm.engine.gate.draft_length = lambda num_requests, draining=None: length  # type: ignore[method-assign]
    return llm


def test_eager_block_drafts_only_the_first_positions(
    tiny_target_dir, tiny_drafter_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """propose(seqs, k): the whole block's first k drafts, nothing past them, k projections a block.
    On the CPU: the eager proposer is the one that drafts position by position (a GPU's decodes the
    block in one kernel and keeps its first k)."""
    # No prompt lookup: a block it copies from the prompt is drafted without the heads.
    config = tiny_engine_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static", device="cpu")
    llm = LLM(config.replace(prompt_lookup=False))
    engine = llm.engine
    block_size = engine.limits.block_size
    prompts = _random_prompts(3)
    # Prefill the requests through the engine so each has a cached context and an anchor.
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    seqs = list(engine.scheduler.running)
    assert seqs
    projections = [0]
    real_logits_at = BlockHeads.logits_at

    def counting(self, position):  # noqa: ANN001, ANN202
        projections[0] += 1
        return real_logits_at(self, position)

    monkeypatch.setattr(BlockHeads, "logits_at", counting)
    whole = engine.proposer.propose(seqs)
    assert projections[0] == block_size
    for k in range(1, block_size):
        projections[0] = 0
        part = engine.proposer.propose(seqs, k)
        assert projections[0] == k
        assert part.tokens[:, :k].tolist() == whole.tokens[:, :k].tolist()
        assert not part.tokens[:, k:].any() and not part.confidences[:, k:].any()
        assert part.lengths is not None and all(n <= k for n in part.lengths.tolist())


@pytest.mark.parametrize("length", [0, 1, 2, 3])
def test_an_engine_held_at_a_length_is_lossless_and_verifies_at_most_it(
    tiny_target_dir, tiny_drafter_dir, length: int
) -> None:
    prompts = _random_prompts(5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    base = tiny_engine_config(tiny_target_dir, tiny_drafter_dir)
    plain = LLM(base.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    for mode in ("static", "compact"):
        llm = _held_at(LLM(base.replace(spec_mode=mode, adaptive_speculation=True)), length)
        assert length <= llm.engine.limits.block_size
        out = llm.generate(params=params, prompt_token_ids=prompts)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], mode
        stats = llm.engine.total_spec_stats
        assert stats.verified_tokens <= length * stats.drafting_steps
        assert (stats.drafting_steps > 0) == (length > 0)
        assert not any(stats.verified_per_position[length:])


def test_sampling_requests_draft_at_the_held_length(tiny_target_dir, tiny_drafter_dir) -> None:
    """Unseeded sampling requests follow the gate too: their blocks stop at its length."""
    llm = _held_at(LLM(tiny_engine_config(tiny_target_dir, tiny_drafter_dir, adaptive_speculation=True)), 1)
    params = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    out = llm.generate(params=params, prompt_token_ids=_random_prompts(4))
    assert all(len(o.token_ids) == 20 for o in out)
    stats = llm.engine.total_spec_stats
    assert stats.drafting_steps > 0
    assert stats.verified_tokens <= stats.drafting_steps


@pytest.mark.parametrize("length", [0, 1, 2])
def test_in_step_drafts_held_at_a_length_through_emulated_graphs(
    tiny_target_dir, tiny_drafter_dir, length: int
) -> None:
    """`static` drafting inside the target step (the GPU path's graphs, emulated; steps launched ahead):
    windows capped below the block still give plain decoding's greedy tokens."""
    prompts = _random_prompts(4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    config = emulated_graphs_config(tiny_target_dir, tiny_drafter_dir, spec_mode="static")
    plain = LLM(config.replace(spec_mode="off")).generate(params=params, prompt_token_ids=prompts)
    llm = LLM(config.replace(adaptive_speculation=True))
    use_emulated_graphs(llm.engine)
    assert llm.engine._drafts_in_step()
    _held_at(llm, length)
    out = llm.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = llm.engine.total_spec_stats
    assert stats.verified_tokens <= length * stats.drafting_steps
    assert (stats.drafting_steps > 0) == (length > 0)


def _schedules(llm: LLM) -> list[tuple[int, int, int]]:
    """Record each step's schedule as (decoding requests, window, prefill tokens)."""
    seen: list[tuple[int, int, int]] = []
    scheduler = llm.engine.scheduler
    real = scheduler.schedule

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        step = real(*args, **kwargs)
        if step is not None and not step.empty:
            window = step.window if step.decode else 0
            seen.append((len(step.decode), window, sum(c.length for c in step.prefill)))
        return step

    scheduler.schedule = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_an_engine_held_at_plain_steps_prefills_as_fast_as_the_plain_engine(
    tiny_target_dir, tiny_drafter_dir, mode: str
) -> None:
    """The gate's choice sizes the windows as they are scheduled: a speculative engine whose gate chose
    plain steps gives prompts the budget a plain engine does (windows of the whole block left them a
    quarter of it while many requests decoded, and prefill took twice the steps at batch 128 on the
    H100), and the same steps in all."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(20, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    base = tiny_engine_config(tiny_target_dir, tiny_drafter_dir, max_num_batched_tokens=32, num_kv_pages=256)
    plain = LLM(base.replace(spec_mode="off"))
    plain_steps = _schedules(plain)
    want = plain.generate(params=params, prompt_token_ids=prompts)
    held = _held_at(LLM(base.replace(spec_mode=mode, adaptive_speculation=True)), 0)
    held_steps = _schedules(held)
    out = held.generate(params=params, prompt_token_ids=prompts)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]
    assert held_steps == plain_steps
    assert any(decoding and prefill for decoding, _, prefill in plain_steps)  # the case in question
