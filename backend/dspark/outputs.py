"""What the engine reports back: per-step deltas and whole completions."""

from __future__ import annotations

import itertools
import json
import os
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import overload


@dataclass
class SpecStats:
    """Speculation counters of one request (or summed over many).

    `accepted_per_position[k]` counts steps where draft k+1 was verified and accepted;
    `verified_per_position[k]` counts steps where it was verified.
    """

    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    # Steps that drafted (the rest decoded plainly: speculation off for the request, or the adaptive
    # gate chose a plain step).
    drafting_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)

    def record_step(self, drafted: int, verified: int, accepted: int) -> None:
        """Count one decode step that drafted, verified and accepted these many tokens."""
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        self.steps += 1
        self.drafting_steps += drafted > 0
        if not verified:  # a plain step (per request per step: kept cheap)
            return
        verified_at, accepted_at = self.verified_per_position, self.accepted_per_position
        if verified > len(verified_at):
            verified_at.extend([0] * (verified - len(verified_at)))
            accepted_at.extend([0] * (len(verified_at) - len(accepted_at)))
        for k in range(verified):
            verified_at[k] += 1
        for k in range(accepted):
            accepted_at[k] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another request's counters into this one."""
        self.drafted_tokens += other.drafted_tokens
        self.verified_tokens += other.verified_tokens
        self.accepted_tokens += other.accepted_tokens
        self.steps += other.steps
        self.drafting_steps += other.drafting_steps
        for name in ("accepted_per_position", "verified_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * max(len(theirs) - len(mine), 0))
            for k, count in enumerate(theirs):
                mine[k] += count

    def __reduce__(self) -> tuple:
        # Positional, not a dataclass's __dict__: a delta batch crosses the engine process's pipe every
        # step, and this halves its pickling on both sides (tests/test_delta_merging.py checks the fields).
        return (
            SpecStats,
            (
                self.drafted_tokens,
                self.verified_tokens,
                self.accepted_tokens,
                self.steps,
                self.drafting_steps,
                self.accepted_per_position,
                self.verified_per_position,
            ),
        )

    @property
    def mean_committed_per_step(self) -> float:
        """tau: tokens committed per decode step, the bonus included."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "drafted_tokens": self.drafted_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "steps": self.steps,
            "drafting_steps": self.drafting_steps,
            "mean_committed_per_step": round(self.mean_committed_per_step, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "verified_per_position": list(self.verified_per_position),
        }


@dataclass(frozen=True)
class Logprob:
    """One token's log probability under the target's raw distribution at a position, its rank there
    (1: the most likely) and its text alone (as vLLM's `Logprob`)."""

    logprob: float
    rank: int
    decoded_token: str


# A committed position's entries: the chosen token and the top-N, by token id (as vLLM's logprobs).
TokenLogprobs = dict[int, Logprob]


def logprobs_json(entries: Sequence[TokenLogprobs] | None) -> str:
    """The `logprobs` output of Triton's vLLM backend: a JSON list with one object per token,
    {"<token id>": {"logprob", "rank", "decoded_token"}}; "null" when the request asked for none."""
    if entries is None:
        return "null"
    return json.dumps(
        [
            {
                str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for token_id, lp in entry.items()
            }
            for entry in entries
        ]
    )


class LogprobsLog:
    """One request's per-token logprobs, append-only, shared by the prefixes its deltas hold.

    `key` names it across processes; `shipped` is how many entries have been pickled already (a delta
    crossing to the adapter's process carries only the entries after it: see `LogprobsPrefix`)."""

    def __init__(self, key: tuple[int, int] | None = None) -> None:
        self.entries: list[TokenLogprobs] = []
        self.shipped = 0
        self.key = key if key is not None else (os.getpid(), next(_log_numbers))


_log_numbers = itertools.count()
# The logs rebuilt in this process from pickled prefixes, by key, until their request's last delta.
_received_logs: dict[tuple[int, int], LogprobsLog] = {}


class LogprobsPrefix(Sequence[TokenLogprobs]):
    """The first `length` entries of a request's `LogprobsLog`: what the request had up to one delta,
    in O(1), unchanged by later steps (which only append).

    Pickled, a prefix carries only the entries after both its own first new one (`start`: the length of
    the request's previous delta's prefix) and those its log already shipped, and unpickling puts them
    into the receiving process's copy of the log, so a stream of deltas costs O(new entries) each on the
    way to the adapter's process (deltas cross one pipe, in order; a delta pickled twice, or one never
    pickled, loses nothing). `final` (the request's last delta) lets the receiver forget the log."""

    def __init__(self, log: LogprobsLog, length: int, start: int = 0, final: bool = False) -> None:
        self._log = log
        self._length = length
        self._start = start
        self.final = final

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> TokenLogprobs: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprobs]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprobs | list[TokenLogprobs]:
        if isinstance(index, slice):
            return [self._log.entries[i] for i in range(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError("logprobs index out of range")
        return self._log.entries[index % self._length]

    def last(self, count: int) -> list[TokenLogprobs]:
        """The entries of the last `count` tokens (those of a delta's `new_token_ids` for its count)."""
        return self[self._length - count :] if count > 0 else []

    def __reduce__(self) -> tuple:
        log = self._log
        start = min(log.shipped, self._start, self._length)
        log.shipped = max(log.shipped, self._length)
        return (
            _received_prefix,
            (log.key, start, log.entries[start : self._length], self._length, self.final),
        )


def _received_prefix(
    key: tuple[int, int], start: int, new: list[TokenLogprobs], length: int, final: bool
) -> LogprobsPrefix:
    """Unpickling: this process's copy of the log, brought to `length` entries, and its prefix."""
    log = _received_logs.setdefault(key, LogprobsLog(key))
    del log.entries[start:]
    log.entries.extend([{}] * (start - len(log.entries)))  # a gap cannot come over one ordered pipe
    log.entries.extend(new)
    log.shipped = len(log.entries)
    if final:
        _received_logs.pop(key, None)
    return LogprobsPrefix(log, length, start, final)


@dataclass
class RequestDelta:
    """What one engine step produced for one request: new tokens and text, and whether it ended.

    `finish_reason` is one of "stop", "length", "abort", "error" once `finished` is True.
    `text_pending`: `new_text` is not made yet (it is ""): the receiver makes its tokens' text
    (`dspark.tokenizer.DeltaText`; the engine process leaves it to the adapter's process).
    `logprobs` (requests that ask, `SamplingParams.logprobs`): one entry per output token so far,
    this delta's included, so a consumer that merges deltas takes the last len(tokens) of the latest;
    `cumulative_logprob`: the sum of the chosen tokens' log probabilities so far.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    spec_stats: SpecStats
    error: str | None = None
    logprobs: LogprobsPrefix | None = None
    cumulative_logprob: float | None = None
    text_pending: bool = False

    def __reduce__(self) -> tuple:
        # Positional, as SpecStats's (see there).
        return (
            RequestDelta,
            (
                self.request_id,
                self.new_token_ids,
                self.new_text,
                self.finished,
                self.finish_reason,
                self.num_prompt_tokens,
                self.num_output_tokens,
                self.spec_stats,
                self.error,
                self.logprobs,
                self.cumulative_logprob,
                self.text_pending,
            ),
        )

    @property
    def new_logprobs(self) -> list[TokenLogprobs] | None:
        """The entries of `new_token_ids` (None when the request did not ask for logprobs)."""
        return None if self.logprobs is None else self.logprobs.last(len(self.new_token_ids))

    @classmethod
    def failed(cls, request_id: str, message: str) -> RequestDelta:
        """The last delta of a request that ended on an error."""
        return cls(request_id, [], "", True, "error", 0, 0, SpecStats(), error=message)


def merge_deltas(deltas: Sequence[RequestDelta]) -> RequestDelta:
    """One delta for a run of one request's deltas: all their tokens and text, the rest (finish, counts,
    statistics, logprobs so far) as of the last."""
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    return replace(
        last,
        new_token_ids=[token for delta in deltas for token in delta.new_token_ids],
        new_text="".join(delta.new_text for delta in deltas),
        # Only an abort or error delta (no tokens, its text given) can follow pending ones.
        text_pending=any(delta.text_pending for delta in deltas),
    )


def merge_by_request(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """The deltas with each request's merged into one, in the order of each request's first."""
    if len({delta.request_id for delta in deltas}) == len(deltas):
        return list(deltas)  # one delta a request (an adapter that keeps up): nothing to merge
    runs: dict[str, list[RequestDelta]] = {}
    for delta in deltas:
        runs.setdefault(delta.request_id, []).append(delta)
    return [merge_deltas(run) for run in runs.values()]


def pack_deltas(deltas: Sequence[RequestDelta]) -> tuple:
    """A batch of deltas as columns, for the engine process's pipe: the ids, every token in one int64
    buffer and every text in one string (each with its end offsets), the counts and statistics in
    int64 buffers, and the rare fields (error, logprobs, cumulative logprob) of the deltas that have
    them, in order. Pickling a few flat columns costs a fraction of an object tree per delta (at 256
    requests a step it was most of the engine process's sender thread); `unpack_deltas` inverts it."""
    tokens: list[int] = []
    token_ends: list[int] = []
    texts: list[str] = []
    text_ends: list[int] = []
    numbers: list[int] = []  # per delta: finished, text pending, prompt and output tokens, 5 SpecStats
    positions: list = []  # per delta: SpecStats's per-position lists, () when both are empty
    reasons: list[str | None] = []
    rare: list[tuple] = []
    text_end = 0
    for index, delta in enumerate(deltas):
        tokens += delta.new_token_ids
        token_ends.append(len(tokens))
        texts.append(delta.new_text)
        text_end += len(delta.new_text)
        text_ends.append(text_end)
        spec = delta.spec_stats
        numbers += (
            delta.finished,
            delta.text_pending,
            delta.num_prompt_tokens,
            delta.num_output_tokens,
            spec.drafted_tokens,
            spec.verified_tokens,
            spec.accepted_tokens,
            spec.steps,
            spec.drafting_steps,
        )
        accepted, verified = spec.accepted_per_position, spec.verified_per_position
        positions.append((accepted, verified) if accepted or verified else ())
        reasons.append(delta.finish_reason)
        if delta.error is not None or delta.logprobs is not None or delta.cumulative_logprob is not None:
            rare.append((index, delta.error, delta.logprobs, delta.cumulative_logprob))
    return (
        [delta.request_id for delta in deltas],
        _int64s(tokens),
        _int64s(token_ends),
        "".join(texts),
        _int64s(text_ends),
        _int64s(numbers),
        positions,
        reasons,
        rare,
    )


def _int64s(values: list[int]) -> bytes:
    """The values as native int64s, the bytes of `array("q", values)` (`unpack_deltas` reads them so):
    struct packs a list ~2x faster than array converts it (50 us for a 256-request step's numbers)."""
    return struct.pack(f"{len(values)}q", *values)


def unpack_deltas(packed: tuple) -> list[RequestDelta]:
    """The deltas `pack_deltas` packed, equal field for field."""
    ids, token_bytes, token_end_bytes, text, text_end_bytes, number_bytes, positions, reasons, rare = packed
    tokens, token_ends, text_ends, numbers = (array("q") for _ in range(4))
    tokens.frombytes(token_bytes)
    token_ends.frombytes(token_end_bytes)
    text_ends.frombytes(text_end_bytes)
    numbers.frombytes(number_bytes)
    deltas = []
    token_start = text_start = 0
    for index, request_id in enumerate(ids):
        token_end, text_end = token_ends[index], text_ends[index]
        finished, pending, prompt, output, drafted, verified, accepted, steps, drafting = numbers[
            9 * index : 9 * index + 9
        ]
        lists = positions[index] or ([], [])
        deltas.append(
            RequestDelta(
                request_id,
                tokens[token_start:token_end].tolist(),
                text[text_start:text_end],
                bool(finished),
                reasons[index],
                prompt,
                output,
                SpecStats(drafted, verified, accepted, steps, drafting, lists[0], lists[1]),
                text_pending=bool(pending),
            )
        )
        token_start, text_start = token_end, text_end
    for index, error, logprobs, cumulative_logprob in rare:
        delta = deltas[index]
        delta.error, delta.logprobs, delta.cumulative_logprob = error, logprobs, cumulative_logprob
    return deltas


@dataclass
class CompletionOutput:
    """A whole completion, as the offline API returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    spec_stats: SpecStats
    # Per output token (requests that ask for logprobs; else None), and their chosen tokens' sum.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class LoopTotals:
    """Where the engine loop's time went since it started (totals; a reader takes differences): the
    steps it launched and the requests in them, the wall time of its step calls, the part of it in the
    acceptance (where the host waits for the device), and the loop's idle time (no request to run).
    (No CPU time of the loop's thread: reading it is a system call, which took ~0.5 ms a step in a
    sandboxed kernel, and a CUDA wait spins on the CPU, so it would not tell waits apart anyway.)"""

    steps: int = 0
    step_requests: int = 0  # requests in each step, summed: / steps = the mean batch
    # Of the steps: those that replayed a captured graph (the rest ran eagerly), those launched ahead
    # of the acceptance of the step before (`launch_ahead`), those that carried a prefill chunk, and
    # those run in decode bursts (`decode_burst`).
    graph_steps: int = 0
    ahead_steps: int = 0
    prefill_steps: int = 0
    burst_steps: int = 0
    bursts: int = 0  # decode bursts launched (burst_steps / bursts: their mean length)
    # Draft tokens the steps verified, summed over their requests (/ step_requests: the drafts a
    # request verified a step, as the adaptive gate chose them).
    verify_tokens: int = 0
    step_seconds: float = 0.0
    # Of `step_seconds`: the calls that launched a step carrying a prefill chunk (with overlap such a call
    # also accepts the step before it): against the rest, what a step that admits a prompt costs.
    prefill_step_seconds: float = 0.0
    accept_seconds: float = 0.0
    idle_seconds: float = 0.0
    # The served loop's time between its steps (AsyncEngine): taking in commands without waiting, and
    # handing each step's deltas to their requests (in the engine process: to its adapters' pipes).
    # With step_seconds and idle_seconds they account for the loop's wall time.
    intake_seconds: float = 0.0
    handover_seconds: float = 0.0
    # Requests the loop admitted; summed over them, the seconds from their hand-over (`AsyncEngine.submit`,
    # in the Triton adapter's process when the engine has a process of its own) to their admission
    # into the engine, and to their first token's delta (a queue, or a late intake, shows here first).
    admitted_requests: int = 0
    intake_wait_seconds: float = 0.0
    first_token_seconds: float = 0.0
    # The step calls' wall time by phase of the step (`STEP_PHASES`), as the host spends it: launching
    # (schedule, draft, plan, layout, target), then accepting (accept, which holds the wait for the
    # device, and emit: committing and making the deltas). They add up to about `step_seconds`.
    host_schedule_seconds: float = 0.0
    host_draft_seconds: float = 0.0
    host_plan_seconds: float = 0.0
    host_layout_seconds: float = 0.0
    host_target_seconds: float = 0.0
    host_accept_seconds: float = 0.0
    host_emit_seconds: float = 0.0
    # The process's cyclic garbage collector since the engine started (`dspark.process_heap`): its
    # passes, those over the oldest generation, and their wall seconds. A pass holds the GIL wherever it
    # starts, so it lengthens whichever phase (or the time between steps) allocated when it began.
    gc_collections: int = 0
    gc_full_collections: int = 0
    gc_seconds: float = 0.0


# The phases of an engine step, in the order a step that waits for its acceptance runs them.
STEP_PHASES = ("schedule", "draft", "plan", "layout", "target", "accept", "emit")


@dataclass
class EngineLoad:
    """A snapshot of the engine's occupancy, for metrics and health."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    # The caching allocator's bytes on the engine's device (tensor-parallel rank 0's), in tensors and
    # held from the driver in all; 0 on the CPU. A stress run watches them for growth between phases.
    gpu_memory_allocated_bytes: int = 0
    gpu_memory_reserved_bytes: int = 0
    loop: LoopTotals = LoopTotals()
    # Speculation counters summed over every finished request (the engine's `total_spec_stats`, a copy
    # made when a request finishes): the speculation gauges are engine-wide ratios of these, the same
    # whichever of the server's instances publishes them.
    spec: SpecStats = field(default_factory=SpecStats)
    # The adaptive gate's view (`SpeculationGate.view`; empty without a gate), flat: GATE_FIELDS for
    # each tier and draft length it measured or chose (`gate_rows` reads them). Flat numbers: the load
    # goes with a batch of deltas whenever a request ended, pickled on the engine loop.
    gate: tuple[float, ...] = ()


# What `EngineLoad.gate` holds per tier (a power-of-two count of decoding requests) and draft length (0:
# plain): the median wall seconds of its latest measured steps (0.0 before one), how many steps were
# measured and chosen, and the tokens a request commits in a step of that length (the acceptance is
# shared by the tiers).
GATE_FIELDS = ("tier", "length", "step_seconds", "measured_steps", "chosen_steps", "tokens_per_request")


def gate_rows(flat: Sequence[float]) -> list[dict[str, float]]:
    """`EngineLoad.gate` as one dict a tier and length (GATE_FIELDS; the counts as ints)."""
    width = len(GATE_FIELDS)
    rows = []
    for start in range(0, len(flat) - width + 1, width):
        row = dict(zip(GATE_FIELDS, flat[start : start + width], strict=True))
        for name in ("tier", "length", "measured_steps", "chosen_steps"):
            row[name] = int(row[name])
        rows.append(row)
    return rows
