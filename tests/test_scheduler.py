"""dspark.engine.scheduler: at high concurrency the decode windows shorten to fit every decoding request
in the step's token budget, and prompts waiting to prefill keep a share of it."""

from __future__ import annotations

from dspark.engine.page_allocator import PageAllocator
from dspark.engine.scheduler import PREFILL_SHARE, Scheduler
from dspark.sampling_params import SamplingParams
from dspark.sequence import Sequence, SequenceStatus

PARAMS = SamplingParams(max_tokens=100, ignore_eos=True)


def _decoding(scheduler: Scheduler, count: int) -> list[Sequence]:
    """`count` running requests past their prompts (8 tokens cached, one output token: the anchor)."""
    seqs = []
    for i in range(count):
        seq = Sequence(f"d{i}", i, list(range(1, 9)), PARAMS, None)
        seq.token_ids.append(5)
        seq.num_cached = 8
        seq.status = SequenceStatus.RUNNING
        assert scheduler.allocator.try_reserve(seq, 8)
        scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def _scheduler(budget: int = 64, window: int = 4) -> Scheduler:
    return Scheduler(PageAllocator(1024, 4), 64, budget, window, 4096)


def test_windows_keep_their_length_while_they_fit() -> None:
    scheduler = _scheduler()
    _decoding(scheduler, 16)  # 16 x 4 = 64 tokens: the whole budget
    step = scheduler.schedule()
    assert len(step.decode) == 16 and step.window >= 4


def test_windows_shorten_so_that_every_decoding_request_runs() -> None:
    scheduler = _scheduler()
    seqs = _decoding(scheduler, 40)  # 40 x 4 = 160 tokens > 64: 40 windows of 1 token (plain steps)
    step = scheduler.schedule()
    assert step.decode == tuple(seqs) and step.window == 1
    scheduler = _scheduler()
    seqs = _decoding(scheduler, 24)  # 24 x 4 = 96 > 64: windows of 2 (one draft each)
    step = scheduler.schedule()
    assert step.decode == tuple(seqs) and step.window == 2


def test_a_waiting_prompt_keeps_a_share_of_the_budget() -> None:
    scheduler = _scheduler()
    seqs = _decoding(scheduler, 16)  # their windows alone would take the whole budget
    waiting = Sequence("new", 99, list(range(1, 41)), PARAMS, None)
    scheduler.add(waiting)
    step = scheduler.schedule()
    share = int(64 * PREFILL_SHARE)
    assert step.decode == tuple(seqs) and step.window == (64 - share) // 16
    assert [c.seq for c in step.prefill] == [waiting]
    assert step.prefill[0].length >= share
    assert len(step.decode) * step.window + step.prefill[0].length <= 64


def test_a_plain_step_leaves_its_windows_budget_to_a_waiting_prompt() -> None:
    """`window_of` (the gate's choice) sizes the windows: a plain step's take one token each, and the
    prompt gets the rest of the budget, not what windows of the whole block would have left it."""
    scheduler = _scheduler()
    seqs = _decoding(scheduler, 16)
    waiting = Sequence("new", 99, list(range(1, 101)), PARAMS, None)
    scheduler.add(waiting)
    asked: list[list[Sequence]] = []

    def plain(decoding: list[Sequence]) -> int:
        asked.append(decoding)
        return 1

    step = scheduler.schedule(window_of=plain)
    assert asked == [seqs]
    assert step.decode == tuple(seqs) and step.window == 1
    assert [(c.seq, c.length) for c in step.prefill] == [(waiting, 64 - 16)]


def test_window_of_caps_the_window_and_never_lengthens_it() -> None:
    scheduler = _scheduler()
    _decoding(scheduler, 4)
    assert scheduler.schedule(window_of=lambda decoding: 2).window == 2
    scheduler = _scheduler()
    _decoding(scheduler, 4)
    assert scheduler.schedule(window_of=lambda decoding: 9).window == 4  # window_positions


def test_window_of_is_not_asked_without_decoding_requests() -> None:
    scheduler = _scheduler()
    scheduler.add(Sequence("new", 99, list(range(1, 41)), PARAMS, None))

    def never(decoding: list[Sequence]) -> int:
        raise AssertionError("asked with no request decoding")

    step = scheduler.schedule(window_of=never)
    assert not step.decode and step.prefill[0].length == 40
