"""SpeculationGate: how many drafts a step verifies, chosen by the speed of earlier steps (0: none).

Whether speculation pays, and with how long a verify window, depends on the machine, the model, the
drafter's acceptance and the batch: on a small model at a large batch, drafting and verifying cost more
than the extra tokens bring; on a CPU whose BLAS runs a window of 4 rows at 1.6x the cost of one, a
window of 2 can pay where 4 loses. The gate keeps, per power-of-two count of decoding requests and per
draft length (0 = plain, then powers of two below the block size, then the block size), a moving
average of committed tokens per second of decode-only steps run with that length, and picks the
fastest; a warm-up tries each length a few times, longest first, and a probe re-measures the losing
lengths now and then, in turn.

Lossless: the decision reads only the wall times and token counts of earlier steps, never this step's
drafts, and every length gives a lossless step. (A seeded sampling request keeps its distribution, but
which steps speculated, and so its exact stream, then depends on timing.)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.runner.cuda_graphs import next_pow2

WARM_UP_STEPS = 3  # steps of each length per batch tier before the averages decide
PROBE_INTERVAL = 32  # every this many steps of a tier, run one losing length once
SMOOTHING = 0.2  # weight of the newest step in each moving average


def draft_lengths(block_size: int) -> tuple[int, ...]:
    """The lengths a gate chooses among for this block size: 0, the powers of two below it, itself."""
    lengths = [0]
    n = 1
    while n < block_size:
        lengths.append(n)
        n *= 2
    return (*lengths, block_size) if block_size > 0 else (0,)


@dataclass
class _TierStats:
    """Moving averages of committed tokens per second, per draft length, for one tier."""

    rates: dict[int, float] = field(default_factory=dict)
    counts: collections.Counter = field(default_factory=collections.Counter)
    steps: int = 0

    def record(self, length: int, rate: float) -> None:
        first = self.counts[length] == 0
        self.rates[length] = rate if first else (1 - SMOOTHING) * self.rates[length] + SMOOTHING * rate
        self.counts[length] += 1


class SpeculationGate:
    """Decides, step by step, how many drafts a step verifies (see the module docstring)."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.perf_counter) -> None:
        """block_size: the longest length (the engine's block); clock: seconds, monotonic (tests pass
        their own)."""
        self.lengths = draft_lengths(block_size)
        self.clock = clock
        self._tiers: dict[int, _TierStats] = {}
        # Launch times and lengths of the steps not yet finished, oldest first (with overlap scheduling
        # a step is launched before the one before it is accepted), and when the last one finished.
        self._started: collections.deque[tuple[float, int]] = collections.deque()
        self._last_finish = float("-inf")

    def draft_length(self, num_requests: int) -> int:
        """How many drafts a step with this many decoding requests verifies at most (0: a plain step)."""
        stats = self._tiers.setdefault(next_pow2(num_requests), _TierStats())
        stats.steps += 1
        for length in reversed(self.lengths):  # the warm-up, longest first
            if stats.counts[length] < WARM_UP_STEPS:
                return length
        winner = max(self.lengths, key=lambda n: stats.rates[n])
        if stats.steps % PROBE_INTERVAL == 0:
            losers = [n for n in self.lengths if n != winner]
            return losers[(stats.steps // PROBE_INTERVAL) % len(losers)]
        return winner

    def start_step(self, length: int, at: float | None = None) -> None:
        """Mark the launch of an engine step that verified up to `length` drafts (0: plain), begun `at`
        (the clock's time; None: now). Each launched step is finished, in launch order."""
        self._started.append((self.clock() if at is None else at, length))

    def finish_step(self, num_requests: int, committed_tokens: int) -> None:
        """Record the oldest launched step, finished: its requests and tokens (a step with prefill chunks
        passes 0 requests: they would skew its rate). Its time is from its launch, or from the finish
        of the step before when that came later (steps overlap): the wall time it added."""
        now = self.clock()
        started = self._started.popleft() if self._started else None
        previous, self._last_finish = self._last_finish, now
        if started is None or num_requests == 0:
            return
        began, length = started
        seconds = max(now - max(began, previous), 1e-9)
        self._tiers.setdefault(next_pow2(num_requests), _TierStats()).record(
            length, committed_tokens / seconds
        )

    def rates(self, num_requests: int) -> dict[int, float]:
        """Committed tokens per second measured for this many requests, per draft length tried."""
        return dict(self._tiers.get(next_pow2(num_requests), _TierStats()).rates)
