"""Where a step's wall time goes: per-phase timers that `LLMEngine.step` feeds (synchronised with the device
when enabled, for benchmarks), and the loop's always-on totals (`LoopCounters`), the host's time per
phase among them."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from dspark.outputs import STEP_PHASES, LoopTotals
from dspark.process_heap import collector_pauses

_HOST_FIELDS = {phase: f"host_{phase}_seconds" for phase in STEP_PHASES}  # LoopTotals' field per phase


class StepTimer:
    """Wall time per phase of the engine step (`STEP_PHASES`). Always: the host's time per phase, added
    to `counters` (two clock reads a phase, no device sync). Enabled (benchmarks, profiling): also
    the split that `summary` reports.

    Enabled on CUDA it synchronises the device at every phase boundary, so device work is charged to
    the phase that queued it (the step gets a little slower; the split is what it is for). With
    `synchronize` off it times the host alone: a phase's figure is then the host's time in it, and
    the phase where the host first waits for the device (greedy acceptance's copy) absorbs the wait."""

    def __init__(self, device: torch.device, counters: LoopCounters, synchronize: bool = True) -> None:
        self.enabled = False
        self.synchronize = synchronize
        self._cuda = device.type == "cuda"
        self._counters = counters
        self._host_last = 0.0
        self._last = 0.0
        self._seconds: dict[str, float] = defaultdict(float)
        self._steps = 0

    def start(self) -> float:
        """Mark the start of a step; returns that moment (`time.perf_counter`)."""
        self._host_last = time.perf_counter()
        if self.enabled:
            self._sync()
            self._last = time.perf_counter()
        return self._host_last

    def finish(self, phase: str, steps: int = 1) -> None:
        """The last lap of a step call that ran: charge it to `phase` and count its `steps` (a burst's
        steps one by one)."""
        if self.enabled:
            self.lap(phase)
            self._steps += steps

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to `phase`."""
        now = time.perf_counter()
        self._counters.add_host(phase, now - self._host_last)
        self._host_last = now
        if self.enabled:
            self._sync()
            now = time.perf_counter()
            self._seconds[phase] += now - self._last
            self._last = now

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, and "steps" (how many steps were timed)."""
        steps = max(self._steps, 1)
        out = {phase: 1e3 * seconds / steps for phase, seconds in self._seconds.items()}
        out["steps"] = float(self._steps)
        return out

    def reset(self) -> None:
        """Forget what was timed."""
        self._seconds.clear()
        self._steps = 0

    def _sync(self) -> None:
        if self._cuda and self.synchronize:
            torch.cuda.synchronize()


class LoopCounters:
    """The engine loop's running totals (`LoopTotals`): a few additions a step, always on, so that a
    server's metrics say whether its engine is busy, idle, or waiting on the device. A step
    counts when it is launched; the time of every `LLMEngine.step` call counts."""

    def __init__(self) -> None:
        # LoopTotals' fields, at zero: `totals` freezes them back into one (the collector's from its
        # process-wide counter, less what it had counted before this engine).
        self.__dict__.update(vars(LoopTotals()))
        pauses = collector_pauses()
        self._gc_before = (pauses.collections, pauses.full_collections, pauses.seconds)

    def add_step(
        self, requests: int, graph: bool, ahead: bool, prefill: bool, verify_tokens: int, burst: bool = False
    ) -> None:
        """A step launched with `requests` requests: replayed from a graph or not, launched ahead of
        the acceptance of the one before or not, with a prefill chunk or not, verifying
        `verify_tokens` drafts in all, in a decode burst or not."""
        self.steps += 1
        self.step_requests += requests
        self.graph_steps += graph
        self.ahead_steps += ahead
        self.prefill_steps += prefill
        self.burst_steps += burst
        self.verify_tokens += verify_tokens

    def add_call(self, seconds: float, prefill: bool = False) -> None:
        """One `LLMEngine.step` call that ran or completed a step: `seconds` of wall time; `prefill`:
        the step it launched carries a prefill chunk."""
        self.step_seconds += seconds
        if prefill:
            self.prefill_step_seconds += seconds

    def add_host(self, phase: str, seconds: float) -> None:
        """`seconds` of the host's time in a phase of a step (`STEP_PHASES`)."""
        field = _HOST_FIELDS[phase]
        setattr(self, field, getattr(self, field) + seconds)

    def totals(self) -> LoopTotals:
        """A snapshot."""
        values = dict(vars(self))  # the same names: LoopTotals is this, frozen
        collections, full, seconds = values.pop("_gc_before")
        pauses = collector_pauses()
        values["gc_collections"] = pauses.collections - collections
        values["gc_full_collections"] = pauses.full_collections - full
        values["gc_seconds"] = pauses.seconds - seconds
        return LoopTotals(**values)
