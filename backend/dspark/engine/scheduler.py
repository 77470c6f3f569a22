"""Scheduler: continuous batching with chunked prefill, page reservation and preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from dspark.engine.page_allocator import PageAllocator
from dspark.sequence import Sequence, SequenceStatus

# With prompts to prefill, decode windows leave at least this share of the step's token budget to
# them: at high concurrency the verify windows alone fill the budget, and a new request then waited
# until enough others ended (time to first token in seconds at 256 streams).
PREFILL_SHARE = 0.25


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, start + length) of `seq` to prefill this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes_prefill(self) -> bool:
        """True when this chunk reaches the sequence's prefill target."""
        return self.start + self.length == self.seq.prefill_target

    @property
    def samples_first_token(self) -> bool:
        """True when this chunk ends a fresh prompt, so the step samples the request's first token from
        its last row (a preempted request resumes with its tokens already chosen)."""
        return self.completes_prefill and self.seq.num_output_tokens == 0


@dataclass(frozen=True)
class StepSchedule:
    """One step's work: decode windows and prefill chunks (run in one target forward), and the most
    target tokens a decode window may take this step (1 + the drafts it may verify): the scheduler
    shortens the windows rather than leave decoding requests out when they do not all fit."""

    decode: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    window: int = 1 << 30

    @property
    def empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class InFlight:
    """What a launched step that is not yet accepted will have done to its requests, for scheduling
    the next step before accepting it (overlap scheduling: `LLMEngine._launch_ahead`).

    advance: positions it caches at least, per request (a verify window: its anchor; a prefill chunk:
    its length); reach: positions past those it may cache too (the window's drafts, if accepted);
    sit_out: requests the next step leaves out (too close to an end for a window whose start is not
    known); follows: per request whose next anchor that step commits, which of its outputs gives it
    (its verify windows in order, then its prefill chunks' first tokens)."""

    advance: dict[Sequence, int]
    reach: dict[Sequence, int]
    sit_out: frozenset[Sequence]
    follows: dict[Sequence, int]

    def cached(self, seq: Sequence) -> int:
        """Positions of `seq` cached once the step is accepted, at least."""
        return seq.num_cached + self.advance.get(seq, 0)


@dataclass
class _Building:
    """A schedule while `Scheduler.schedule` builds it (preemption takes requests out again)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)


class Scheduler:
    """Admits waiting requests, reserves each running request's verify window, preempts the youngest
    request (freeing its pages; it is recomputed later) when pages run out.

    `window_positions` is how many cache positions past `num_cached` a decode step may write: the
    draft block (block_size) and the verify window (1 + block_size), so block_size + 1 with
    speculation, 1 without.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        window_positions: int,
        max_model_len: int,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.window_positions = window_positions
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq)

    def _decode_window(self, decoding: int, budget: int, prefill_waits: bool, most: int) -> tuple[int, int]:
        """The longest window, up to `most` positions, that `decoding` requests can all take within the
        budget, leaving PREFILL_SHARE of it to prompts when some wait; and the budget the windows may use."""
        if prefill_waits:
            budget -= int(budget * PREFILL_SHARE)
        window = most
        if decoding * window > budget:
            window = max(1, budget // decoding)
        return window, budget

    def schedule(
        self,
        in_flight: InFlight | None = None,
        window_of: Callable[[list[Sequence]], int] | None = None,
        admit: bool = True,
    ) -> StepSchedule | None:
        """Choose this step's decode windows and prefill chunks.

        `window_of` gives, from the requests that decode this step, the most positions a window takes
        (1 + the drafts the step verifies at most, the speculation gate's choice; None: window_positions):
        a plain step's windows leave the rest of the token budget to prompts (whole windows kept for
        drafts the step would not verify left prompts 128 of 512 tokens at batch 128, against a plain
        engine's 384: 107 steps for its 91 at 256 requests on the H100).

        With `in_flight` (a step launched and not yet accepted) the requests are scheduled from where
        that step leaves them at least, and nobody is preempted: None, with nothing scheduled but pages
        reserved, when a decoding request's window does not fit (schedule again once it is accepted).

        `admit` False leaves waiting prompts waiting, unless the step carries a prompt's chunk anyway or
        nothing decodes (the engine's decode bursts: a step without prompts may be one)."""
        plan = _Building()
        budget = self.max_num_batched_tokens
        cached = in_flight.cached if in_flight is not None else _cached
        decoding: list[tuple[Sequence, int]] = []  # with the positions cached once in flight is done
        prefilling: list[Sequence] = []  # oldest first, as the decoding ones
        running = SequenceStatus.RUNNING
        for seq in self._by_arrival(in_flight):
            now = cached(seq)  # once for both loops: this runs per request on every step
            if now >= seq.prefill_target and seq.status is running:
                decoding.append((seq, now))
            else:
                prefilling.append(seq)
        admit = admit or bool(prefilling) or not decoding
        admits = admit and bool(self.waiting) and len(self.running) < self.max_num_seqs
        most = self.window_positions
        if window_of is not None and decoding:
            most = max(1, min(most, window_of([seq for seq, _ in decoding])))
        window, decode_budget = self._decode_window(len(decoding), budget, admits or bool(prefilling), most)
        # Per request on every step: the limits in locals, and a request whose pages already hold its
        # window skips the allocator (host time at batch 64).
        reach = in_flight.reach if in_flight is not None else {}
        window_positions, page_size = self.window_positions, self.allocator.page_size
        for seq, now in decoding:
            if seq.status is not running:  # preempted by an earlier one's reservation
                continue
            need = min(window, max(seq.remaining_tokens, 1))  # less past its max_tokens
            if need > decode_budget:
                continue
            if in_flight is not None:
                # The window may start as late as everything in flight reaches, and reserves from there.
                positions = now + reach.get(seq, 0) + window_positions
                if positions > len(seq.pages) * page_size and not self.allocator.try_reserve(seq, positions):
                    return None
            elif not self._reserve_or_preempt(seq, plan):
                continue
            plan.decode.append(seq)
            budget -= need
            decode_budget -= need
        # The decode windows' reservations may have preempted some of the prefilling requests.
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and cached(seq) < seq.prefill_target:
                budget -= self._schedule_prefill(seq, budget, plan, cached(seq))
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk = self._schedule_prefill(seq, budget, plan, seq.num_cached)
            if chunk == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= chunk
        return StepSchedule(tuple(plan.decode), tuple(plan.prefill), window)

    def _by_arrival(self, in_flight: InFlight | None) -> list[Sequence]:
        """The running requests, oldest first (less those sitting the step out)."""
        running = sorted(self.running, key=_arrival)
        if in_flight is None:
            return running
        return [seq for seq in running if seq not in in_flight.sit_out]

    def _schedule_prefill(self, seq: Sequence, budget: int, plan: _Building, cached: int) -> int:
        length = min(seq.prefill_target - cached, budget)
        if length <= 0 or not self.allocator.try_reserve(seq, cached + length):
            return 0
        plan.prefill.append(PrefillChunk(seq, cached, length))
        return length

    def _reserve_or_preempt(self, seq: Sequence, plan: _Building) -> bool:
        """Reserve the window of `seq`, preempting the youngest other requests if needed."""
        positions = min(seq.num_cached + self.window_positions, self.max_model_len + self.window_positions)
        if positions <= len(seq.pages) * self.allocator.page_size:
            return True  # its pages hold the window already (most steps): no allocator call
        while not self.allocator.try_reserve(seq, positions):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: _Building) -> None:
        self.running.remove(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.prefill = [c for c in plan.prefill if c.seq is not seq]
        self.allocator.release(seq)
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def _cached(seq: Sequence) -> int:
    return seq.num_cached


_arrival = attrgetter("arrival")
