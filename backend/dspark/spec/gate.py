"""SpeculationGate: draft only on the steps where speculation has been paying.

Whether speculation pays depends on the machine, the model, the drafter's acceptance and the batch:
on a small model at a large batch, drafting and verifying cost more than the extra tokens bring. The
gate keeps, per power-of-two count of decoding requests, a moving average of committed tokens per
second of decode-only steps run with speculation and of those run without, and picks the faster; a
warm-up tries each a few times and a probe re-measures the losing side now and then.

Lossless: the decision reads only the wall times and token counts of earlier steps, never this step's
drafts, and both kinds of step are lossless on their own. (A seeded sampling request keeps its
distribution, but which steps speculated, and so its exact stream, then depends on timing.)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.runner.cuda_graphs import next_pow2

WARM_UP_STEPS = 3  # steps of each kind per batch tier before the averages decide
PROBE_INTERVAL = 32  # every this many steps of a tier, run the side that is losing once
SMOOTHING = 0.2  # weight of the newest step in each moving average


@dataclass
class _TierStats:
    """Moving averages of committed tokens per second, with and without speculation, for one tier."""

    # Indexed by int(speculative): [plain, speculative].
    rates: list[float] = field(default_factory=lambda: [0.0, 0.0])
    counts: list[int] = field(default_factory=lambda: [0, 0])
    steps: int = 0

    def record(self, speculative: bool, rate: float) -> None:
        i = int(speculative)
        first = self.counts[i] == 0
        self.rates[i] = rate if first else (1 - SMOOTHING) * self.rates[i] + SMOOTHING * rate
        self.counts[i] += 1


class SpeculationGate:
    """Decides, step by step, whether the engine drafts (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """clock: seconds, monotonic (tests pass their own)."""
        self.clock = clock
        self._tiers: dict[int, _TierStats] = {}
        # Launch times of the steps not yet finished, oldest first (with overlap scheduling a step is
        # launched before the one before it is accepted), and when the last one finished.
        self._started: collections.deque[float] = collections.deque()
        self._last_finish = float("-inf")

    def should_speculate(self, num_requests: int) -> bool:
        """Whether a step with this many decoding requests should draft."""
        stats = self._tiers.setdefault(next_pow2(num_requests), _TierStats())
        stats.steps += 1
        plain_count, spec_count = stats.counts
        if spec_count < WARM_UP_STEPS:
            return True
        if plain_count < WARM_UP_STEPS:
            return False
        plain_rate, spec_rate = stats.rates
        winner = spec_rate >= plain_rate
        return not winner if stats.steps % PROBE_INTERVAL == 0 else winner

    def start_step(self, at: float | None = None) -> None:
        """Mark the launch of an engine step, begun `at` (the clock's time; None: now). Each launched
        step is finished, in launch order."""
        self._started.append(self.clock() if at is None else at)

    def finish_step(self, num_requests: int, speculative: bool, committed_tokens: int) -> None:
        """Record the oldest launched step, finished: requests, kind, tokens (a step with prefill chunks
        passes 0 requests: they would skew its rate). Its time is from its launch, or from the finish
        of the step before when that came later (steps overlap): the wall time it added."""
        now = self.clock()
        started = self._started.popleft() if self._started else None
        previous, self._last_finish = self._last_finish, now
        if started is None or num_requests == 0:
            return
        seconds = max(now - max(started, previous), 1e-9)
        self._tiers.setdefault(next_pow2(num_requests), _TierStats()).record(
            speculative, committed_tokens / seconds
        )

    def rates(self, num_requests: int) -> tuple[float, float]:
        """(plain, speculative) committed tokens per second measured for this many requests."""
        plain, speculative = self._tiers.get(next_pow2(num_requests), _TierStats()).rates
        return plain, speculative
