"""Self-distillation answers through the engine (dspark.training.feed): the running batch stays full while
jobs are left, requests go in phases of one kind (greedy or sampled) whose kinds mix only at a changeover,
greedy answers equal plain greedy decoding and sampled ones the request's own seed, and a deadline is kept
(the held-out jobs always answered), by the dense fallback too."""

from __future__ import annotations

import random
import time

import pytest
import torch
from tiny_models import tiny_engine_config

from dspark import LLM, SamplingParams
from dspark.runner.models.loader import load_target_model
from dspark.training.data import DistillRecord
from dspark.training.feed import Deadline, answer_dense, answer_with_engine, is_greedy, phases

MAX_NUM_SEQS = 4


def _jobs(count: int, seed: int = 0) -> list[tuple[str, str, list[int]]]:
    rng = random.Random(seed)
    return [
        (f"p{i}", "chat", [rng.randrange(1, 8) for _ in range(rng.randrange(2, 8))]) for i in range(count)
    ]


def _temperatures(count: int, sampled_share: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [1.0 if rng.random() < sampled_share else 0.0 for _ in range(count)]


@pytest.fixture(autouse=True)
def one_thread():
    """Torch on one thread while these tests time things: two OpenMP threads that another busy process
    keeps waiting for each other can make a step of the tiny model last seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(tiny_target_dir):
    """A plain-decoding engine of the tiny target, as distill-data builds it (fp32 on the CPU)."""
    config = tiny_engine_config(tiny_target_dir, spec_mode="off", max_num_seqs=MAX_NUM_SEQS, dtype="float32")
    with LLM(config) as llm:
        yield llm


def test_phases_hold_one_kind_each_alternate_and_keep_the_shares() -> None:
    temperatures = _temperatures(300, 0.7)
    out = phases(temperatures, 10, first=25)
    flat = [i for phase in out for i in phase]
    assert sorted(flat) == list(range(300))
    kinds = [{is_greedy(temperatures[i]) for i in phase} for phase in out]
    assert all(len(k) == 1 for k in kinds)
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))  # alternating while both last
    # The held-out jobs (the first 25) before all others; each kind in job order.
    assert sorted(flat[:25]) == list(range(25))
    for greedy in (True, False):
        mine = [i for i in flat if is_greedy(temperatures[i]) == greedy]
        assert mine == sorted(mine)
    # Wherever the run stops, what it started holds each kind in about its share: off by a phase at most.
    share = sum(not is_greedy(t) for t in temperatures) / 300
    for stop in range(60, 300):
        started = flat[:stop]
        sampled = sum(not is_greedy(temperatures[i]) for i in started)
        assert abs(sampled - share * stop) <= 20 + 1, stop


def test_the_batch_stays_full_and_mixes_kinds_only_at_a_changeover(llm) -> None:
    engine = llm.engine
    jobs, temperatures = _jobs(120), _temperatures(120, 0.5)
    schedules: list[tuple[int, set[bool]]] = []
    fed: list[tuple[int, float]] = []  # (schedules so far, temperature) of every request added
    ahead = [0]
    scheduler = engine.scheduler
    schedule, add_request, launch_ahead = scheduler.schedule, engine.add_request, engine._launch_ahead

    def spy_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        schedules.append((len(scheduler.running), {s.params.greedy for s in scheduler.running}))
        return out

    def spy_add(request_id, prompt, params):
        fed.append((len(schedules), params.temperature))
        add_request(request_id, prompt, params)

    def spy_launch_ahead(earlier):
        launched, queued = launch_ahead(earlier)
        ahead[0] += launched is not None
        return launched, queued

    engine.scheduler.schedule, engine.add_request, engine._launch_ahead = (
        spy_schedule,
        spy_add,
        spy_launch_ahead,
    )
    records: dict[int, DistillRecord] = {}
    try:
        stats = answer_with_engine(llm, jobs, temperatures, 24, records.__setitem__, phase_answers=15, seed=3)
    finally:
        del engine.scheduler.schedule, engine.add_request, engine._launch_ahead
    assert stats.answered == len(records) == 120
    # Requests went in phases of one kind: as many changes of kind as phase boundaries.
    changes = sum(is_greedy(a) != is_greedy(b) for (_, a), (_, b) in zip(fed, fed[1:], strict=False))
    assert changes == len(phases(temperatures, 15)) - 1 >= 6
    # From its first filling until the last request was added, every step ran a full batch: no batch
    # drained before the next requests came.
    first_full = next(n for n, (running, _) in enumerate(schedules) if running == MAX_NUM_SEQS)
    last_fed = fed[-1][0]
    assert all(running == MAX_NUM_SEQS for running, _ in schedules[first_full:last_fed])
    # The kinds share a batch only while one phase gives way to the next: until the old kind's last
    # requests end (within 24 tokens, a step or two of prefill besides).
    mixed = sum(len(kinds) == 2 for _, kinds in schedules)
    assert mixed <= changes * 26
    # Greedy-only batches let the engine launch a step ahead of the one before (a sampling request in
    # the batch would stop it): most of them did.
    greedy_only = sum(kinds == {True} for _, kinds in schedules)
    assert greedy_only > 100 and ahead[0] > greedy_only // 2, (ahead[0], greedy_only)


def test_greedy_answers_equal_plain_greedy_and_sampled_ones_their_own_seed(llm) -> None:
    jobs, temperatures = _jobs(30, seed=4), _temperatures(30, 0.5, seed=5)
    records: dict[int, DistillRecord] = {}
    answer_with_engine(llm, jobs, temperatures, 20, records.__setitem__, phase_answers=4, seed=7)
    rng = random.Random(7)
    seeds = [rng.randrange(2**31) for _ in jobs]
    params = [
        SamplingParams(max_tokens=20, temperature=t, seed=s) for t, s in zip(temperatures, seeds, strict=True)
    ]
    # Each answer alone, with its own seed: what the feed's answers, batched otherwise, must equal.
    alone = [
        llm.generate(params=[p], prompt_token_ids=[job[2]])[0] for p, job in zip(params, jobs, strict=True)
    ]
    assert sorted(records) == list(range(30))
    for i, record in records.items():
        assert (record.id, record.domain, record.prompt_ids) == jobs[i]
        assert record.temperature == temperatures[i]
        assert record.response_ids == alone[i].token_ids, i
    assert {r.temperature for r in records.values()} == {0.0, 1.0}


def test_the_engine_keeps_the_deadline_and_always_answers_the_held_out_jobs(llm) -> None:
    jobs, temperatures = _jobs(3000, seed=6), _temperatures(3000, 0.5)
    records: dict[int, DistillRecord] = {}
    began = time.monotonic()
    # 4 s, of which the reserve keeps 0.5 s for what follows generation (long enough for more than 50
    # answers on a loaded 2-core machine: 2 s gave 27 once).
    deadline = Deadline(began + 4.0, lambda: 0.5)
    stats = answer_with_engine(
        llm, jobs, temperatures, 48, records.__setitem__, phase_answers=50, deadline=deadline, held_out=20
    )
    elapsed = time.monotonic() - began
    assert elapsed < 3.5 + 1.0, elapsed
    assert set(range(20)) <= set(records)
    assert stats.answered == len(records) and 50 < stats.answered < 3000
    assert stats.answered + stats.aborted + stats.unanswered == 3000
    assert not llm.engine.has_unfinished_requests()
    # Past the deadline from the start: the held-out jobs alone, all of them.
    records.clear()
    stats = answer_with_engine(
        llm, jobs, temperatures, 16, records.__setitem__, deadline=Deadline(time.monotonic()), held_out=20
    )
    assert sorted(records) == list(range(20)) and stats.unanswered == 3000 - 20


def test_the_dense_batches_keep_the_deadline_and_answer_the_held_out_jobs_first(tiny_target_dir) -> None:
    model = load_target_model(tiny_target_dir)
    jobs, temperatures = _jobs(4000, seed=8), _temperatures(4000, 0.5)
    records: dict[int, DistillRecord] = {}
    began = time.monotonic()
    stats = answer_dense(
        model,
        jobs,
        temperatures,
        [0],
        32,
        16,
        records.__setitem__,
        deadline=Deadline(began + 1.5),
        held_out=20,
    )
    elapsed = time.monotonic() - began
    assert elapsed < 1.5 + 1.0, elapsed
    assert set(range(20)) <= set(records) and 20 < stats.answered < 4000
    assert stats.answered + stats.unanswered == 4000


def test_requests_still_running_when_the_deadline_comes_are_aborted_but_held_out_ones(llm) -> None:
    jobs, temperatures = _jobs(400, seed=9), _temperatures(400, 0.5)
    records: dict[int, DistillRecord] = {}
    began = time.monotonic()
    # What follows generation turns out to need far more than foreseen: the deadline is past at once,
    # with requests in flight (the first four of them held out).
    deadline = Deadline(began + 60.0, lambda: 0.0 if time.monotonic() < began + 0.3 else 3600.0)
    stats = answer_with_engine(
        llm, jobs, temperatures, 200, records.__setitem__, deadline=deadline, held_out=4
    )
    assert time.monotonic() - began < 0.3 + 1.0
    assert stats.aborted > 0 and set(range(4)) <= set(records)
    assert stats.answered + stats.aborted + stats.unanswered == 400
    assert not llm.engine.has_unfinished_requests()
