"""overlap_scheduling: a step's text and deltas are made while the device runs the next step. Every
request gets the same deltas either way, in the same order (under preemption the scheduler, not yet
knowing what the step in flight commits, may preempt other requests and so make up steps differently:
the tokens are the same, a logprob the same to fp32 rounding)."""

from __future__ import annotations

import random

import pytest
from tiny_models import tiny_engine_config

from dspark import LLMEngine, SamplingParams

MAX_CALLS = 5000  # far more steps than any of these runs takes: more is a livelock, not slowness


def _params(count: int, rng: random.Random, vocab: int = 8) -> list[SamplingParams]:
    """A mix of what a step can commit: greedy to a length, stop ids, stop strings, logprobs,
    penalties, seeded sampling, short and long outputs, EOS."""
    kinds = [
        lambda: SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True),
        lambda: SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[rng.randrange(1, vocab)]),
        lambda: SamplingParams(max_tokens=20, ignore_eos=True, stop=[f"w{rng.randrange(1, vocab)}"]),
        lambda: SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2),
        lambda: SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        lambda: SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=rng.randrange(1000)),
        lambda: SamplingParams(max_tokens=40),
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def _deltas_by_request(engine: LLMEngine, prompts, params, abort_after: dict[str, int] | None = None):
    """Every request's deltas, in the order the engine gave them; `abort_after`: request id -> the call
    after which it is aborted."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    out: dict[str, list[tuple]] = {f"r{i}": [] for i in range(len(prompts))}
    calls = 0
    while engine.has_unfinished_requests():
        assert calls < MAX_CALLS, "the engine stopped making progress"
        for d in engine.step():
            logprobs = [dict(entry) for entry in d.logprobs] if d.logprobs is not None else None
            out[d.request_id].append(
                (tuple(d.new_token_ids), d.new_text, d.finished, d.finish_reason, logprobs, d.error)
            )
        calls += 1
        for request_id, after in (abort_after or {}).items():
            if calls == after:
                engine.abort_request(request_id)
    return out


def _assert_same_deltas(got: dict[str, list[tuple]], expected: dict[str, list[tuple]]) -> None:
    """The same deltas per request: tokens, text, finish and error exactly, each logprob's token ids
    and ranks exactly and its value to fp32 rounding. (About one draw in 400 of the test below, plain
    decoding under preemption, gave logprobs ~1e-6 apart with every token the same: with overlap the
    scheduler preempted 3 times against 2, so steps were made up differently from the second on, and a
    CPU product's path, and so its last bits, depends on the step's row count.)"""
    assert got.keys() == expected.keys()
    for request_id, deltas in expected.items():
        assert len(got[request_id]) == len(deltas), request_id
        for mine, theirs in zip(got[request_id], deltas, strict=True):
            assert mine[:4] == theirs[:4] and mine[5] == theirs[5], request_id
            assert (mine[4] is None) == (theirs[4] is None), request_id
            for a, b in zip(mine[4] or [], theirs[4] or [], strict=True):
                assert a.keys() == b.keys(), request_id
                for token_id, entry in a.items():
                    other = b[token_id]
                    assert (entry.rank, entry.decoded_token) == (other.rank, other.decoded_token), request_id
                    assert entry.logprob == pytest.approx(other.logprob, rel=1e-5, abs=1e-5), request_id


@pytest.mark.parametrize("mode", ["off", "static", "compact"])
def test_overlap_gives_every_request_the_same_deltas(tiny_target_dir, tiny_drafter_dir, mode) -> None:
    rng = random.Random()
    # A small cache and step budget: preemption and chunked prefill happen too.
    config = tiny_engine_config(
        tiny_target_dir, tiny_drafter_dir, spec_mode=mode, num_kv_pages=40, max_num_batched_tokens=24
    )
    # About 1 draw in 30 ends early enough that nothing is preempted: draw again then (plain decoding
    # only, where the check below holds), so that every run covers preemption.
    for _ in range(20):
        prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 14))] for _ in range(14)]
        params = _params(len(prompts), rng)
        reference = LLMEngine(config.replace(overlap_scheduling=False))
        waiting = _deltas_by_request(reference, prompts, params)
        if mode != "off" or reference.scheduler.num_preemptions > 0:
            break
    engine = LLMEngine(config.replace(overlap_scheduling=True))
    overlapped = _deltas_by_request(engine, prompts, params)
    _assert_same_deltas(overlapped, waiting)
    assert all(deltas and deltas[-1][2] for deltas in overlapped.values())  # each ends once
    assert engine.allocator.num_used == 0
    if mode == "off":  # (speculative modes reserve their windows differently)
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for the batch"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_preempted_for_a_window_is_not_prefilled_in_the_same_step(tiny_target_dir, overlap) -> None:
    """Seed 2 of this file's mix preempts the two youngest decoding requests for older ones' windows;
    the step's prefill pass must not then schedule a chunk of either (a snapshot of the running
    requests taken before the preemptions once did: the request ran while waiting, and the engine
    never finished)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 8) for _ in range(rng.randrange(2, 14))] for _ in range(14)]
    params = _params(len(prompts), rng)
    config = tiny_engine_config(tiny_target_dir, spec_mode="off", num_kv_pages=40, max_num_batched_tokens=24)
    engine = LLMEngine(config.replace(overlap_scheduling=overlap))
    out = _deltas_by_request(engine, prompts, params)
    assert all(deltas and deltas[-1][2] for deltas in out.values())
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_used == 0


def test_a_call_returns_with_the_next_step_launched(tiny_target_dir) -> None:
    """The first call launches the prompt's step and returns nothing; the next accepts it (the first
    token) and launches the step after; without overlap the first call returns the first token."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for overlap, first_call in ((True, []), (False, [1])):
        engine = LLMEngine(tiny_engine_config(tiny_target_dir, spec_mode="off", overlap_scheduling=overlap))
        engine.add_request("a", [1, 2, 3], params)
        assert [len(d.new_token_ids) for d in engine.step()] == first_call
        assert engine.has_unfinished_requests()
        counts = first_call + [len(d.new_token_ids) for _ in range(8) for d in engine.step()]
        assert counts == [1, 1, 1]
        assert not engine.has_unfinished_requests()


@pytest.mark.shipped_overlap
def test_on_a_cpu_a_call_returns_the_tokens_of_the_step_it_ran(tiny_target_dir) -> None:
    """A CPU runs a step inside its launch: overlap there would only hold each step's tokens back a
    call, so the engine (overlap_scheduling on, the default) waits for each step on the CPU."""
    import torch

    from dspark.engine.llm_engine import device_runs_ahead

    assert not device_runs_ahead(torch.device("cpu")) and device_runs_ahead(torch.device("cuda"))
    engine = LLMEngine(tiny_engine_config(tiny_target_dir, spec_mode="off", device="cpu"))
    assert engine.config.overlap_scheduling and not engine.overlaps
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(d.new_token_ids) for d in engine.step()] == [1]


def test_an_abort_while_a_step_is_launched_ends_after_its_committed_tokens(tiny_target_dir) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)] * 2
    config = tiny_engine_config(tiny_target_dir, spec_mode="off")
    full = _deltas_by_request(LLMEngine(config.replace(overlap_scheduling=False)), prompts, params)
    engine = LLMEngine(config)
    out = _deltas_by_request(engine, prompts, params, abort_after={"r0": 4})
    aborted = out["r0"]
    # Tokens the launched step committed come first, then the end; they are the full run's prefix.
    assert aborted[-1][:4] == ((), "", True, "abort")
    assert aborted[:-1] and all(not d[2] for d in aborted[:-1])
    assert aborted[:-1] == full["r0"][: len(aborted) - 1]
    assert aborted[-1][4] == aborted[-2][4]  # the end adds no logprobs entry
    # r1 runs alone after the abort: its logprobs may round differently in a batch of one.
    assert [d[:4] for d in out["r1"]] == [d[:4] for d in full["r1"]]
    assert engine.allocator.num_used == 0
