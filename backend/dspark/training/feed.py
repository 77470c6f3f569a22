"""The target's answers to self-distillation prompts, handed on one by one as they finish, within a deadline.

Through the serving engine (`answer_with_engine`) the running batch is kept full: a request is added as
soon as another one finishes (the engine's `add_request` / `step` loop, as the serving path drives it),
so no batch drains to its longest answer before the next one starts. Requests go in phases of one kind,
greedy or sampled (`phases`): the engine launches a step ahead of the one on the device only while every
running request decides its tokens on the device (`launch_ahead`), which a single sampling request in
the batch stops; kept apart, greedy phases keep that overlap and only the changeover between two phases
mixes the kinds. The dense fallback (`answer_dense`) answers padded batches.

Each answer goes to `on_record` as it finishes (the shard writer), so nothing waits for the end. With a
`Deadline`, no request starts that could not finish by it at the measured pace, requests still running
when it comes are aborted (their partial answers dropped), and the deadline already leaves the time its
`reserve` asks for (writing the last shard). The first `held_out` jobs (the held-out prompts, which
evaluation needs) go first and are always answered, deadline or not.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dspark.sampling_params import GREEDY_BELOW_TEMPERATURE, SamplingParams
from dspark.training.generate import generate_batch
from dspark.training.records import DistillRecord

if TYPE_CHECKING:
    from dspark.llm import LLM
    from dspark.runner.models.llama import CausalLM

# (prompt id, domain, prompt token ids): one answer to generate.
Job = tuple[str, str, list[int]]
OnRecord = Callable[[int, DistillRecord], None]
PROGRESS_EVERY_S = 10.0
# Answers in a phase of one kind, by default, in running batches (max_num_seqs). A changeover mixes the
# kinds until the old kind's last requests end (up to max_new_tokens steps), so a phase should run many
# times longer than that; a run stopped early is off its share of each kind by at most a phase.
PHASE_BATCHES = 16


def say(line: str) -> None:
    """Write one progress line to stderr in one piece (the shard writer's thread writes there too)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _nothing() -> float:
    return 0.0


@dataclass
class Deadline:
    """When generation must be over: `at` (a `time.monotonic()` time) less the seconds that `reserve`
    says the work after it needs (writing the last shard, closing the engine)."""

    at: float
    reserve: Callable[[], float] = _nothing

    @classmethod
    def after(cls, seconds: float, reserve: Callable[[], float] = _nothing) -> Deadline | None:
        """A deadline `seconds` from now; None for 0 (no deadline)."""
        return cls(time.monotonic() + seconds, reserve) if seconds > 0 else None

    def left(self) -> float:
        """Seconds left for generation (negative once past)."""
        return self.at - time.monotonic() - self.reserve()


@dataclass
class FeedStats:
    """What a generation did: answers handed on, their tokens, requests aborted at the deadline, jobs
    never started, requests that failed."""

    answered: int = 0
    tokens: int = 0
    aborted: int = 0
    unanswered: int = 0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        """Seconds since the generation started."""
        return time.monotonic() - self.started

    @property
    def tokens_per_second(self) -> float:
        """Answer tokens a second so far."""
        return self.tokens / max(self.seconds, 1e-9)


def is_greedy(temperature: float) -> bool:
    """Whether a job at `temperature` decodes by argmax (as `SamplingParams.greedy` decides)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


def phases(temperatures: Sequence[float], phase_answers: int, first: int = 0) -> list[list[int]]:
    """Job indices in phases of one kind, greedy or sampled, the kinds alternating; each kind in job order.

    The first `first` jobs (held out) go before all others, their greedy ones first. Then a greedy and a
    sampled phase together hold 2 * `phase_answers` jobs, split by the kinds' shares of those jobs, so
    wherever a run stops, the answers started by then hold each kind in about its share (off by at most
    a phase).
    """
    if phase_answers < 1:
        raise ValueError(f"phase_answers: must be >= 1, got {phase_answers}")
    kinds = [is_greedy(t) for t in temperatures]
    out = [[i for i in range(first) if kinds[i] == greedy] for greedy in (True, False)]
    greedy = [i for i in range(first, len(kinds)) if kinds[i]]
    sampled = [i for i in range(first, len(kinds)) if not kinds[i]]
    if greedy or sampled:
        cycle = 2 * phase_answers
        greedy_size = min(max(1, round(cycle * len(greedy) / (len(greedy) + len(sampled)))), cycle - 1)
        greedy_phases = [greedy[k : k + greedy_size] for k in range(0, len(greedy), greedy_size)]
        size = cycle - greedy_size
        sampled_phases = [sampled[k : k + size] for k in range(0, len(sampled), size)]
        for k in range(max(len(greedy_phases), len(sampled_phases))):
            out += [p[k] for p in (greedy_phases, sampled_phases) if k < len(p)]
    merged: list[list[int]] = []
    for phase in out:
        if merged and phase and kinds[merged[-1][0]] == kinds[phase[0]]:
            merged[-1] += phase  # a kind's held-out jobs, or its last phases, run on into its next phase
        elif phase:
            merged.append(phase)
    return merged


class _Progress:
    """Progress lines on stderr, at most every PROGRESS_EVERY_S seconds (and a last one)."""

    def __init__(self, stats: FeedStats, total: int) -> None:
        self.stats, self.total = stats, total
        self.next_at = time.monotonic() + PROGRESS_EVERY_S

    def tick(self, detail: str, final: bool = False) -> None:
        if not final and time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + PROGRESS_EVERY_S
        stats = self.stats
        say(
            f"distill: {stats.answered}/{self.total} answers, {stats.tokens} tokens, "
            f"{stats.tokens_per_second:.0f} tokens/s, {stats.seconds:.0f} s{detail}"
        )


def answer_with_engine(
    llm: LLM,
    jobs: Sequence[Job],
    temperatures: Sequence[float],
    max_new_tokens: int,
    on_record: OnRecord,
    phase_answers: int = 0,
    seed: int = 0,
    deadline: Deadline | None = None,
    held_out: int = 0,
) -> FeedStats:
    """Answer `jobs` (each at its temperature, a sampled one with its own seed drawn from `seed`) through
    the engine of `llm`, a plain-decoding engine of the target; each answer goes to `on_record` (job
    index, record) as it finishes, in no particular order.

    The engine holds its `max_num_seqs` requests and a few more waiting, so a finished request's place
    is taken at the next step. phase_answers: answers per phase of one kind (0: PHASE_BATCHES x max_num_seqs).
    """
    engine = llm.engine
    rng = random.Random(seed)
    seeds = [rng.randrange(2**31) for _ in jobs]
    concurrent = engine.config.max_num_seqs
    order = deque(
        i
        for phase in phases(temperatures, phase_answers or PHASE_BATCHES * concurrent, held_out)
        for i in phase
    )
    # Queued beyond the batch: a slot that frees is filled by the engine's next schedule, not one later.
    most_queued = concurrent + max(4, concurrent // 8)
    stats = FeedStats()
    progress = _Progress(stats, len(jobs))
    running: dict[str, tuple[int, list[int]]] = {}
    step_seconds = 0.0  # the recent pace of engine steps (an exponential average)
    aborted = False
    kind = ""
    last = time.monotonic()
    unstarted: set[str] = set()  # requests taken back from the engine's queue before they started
    feeding = True
    while True:
        if deadline is not None and feeding and deadline.left() < (max_new_tokens + 2) * step_seconds:
            # A request started now could not finish in time: only the held-out jobs still start, and
            # those waiting in the engine's queue are taken back.
            feeding = False
            kept = deque(i for i in order if i < held_out)
            stats.unanswered += len(order) - len(kept)
            order = kept
            for seq in engine.scheduler.waiting:
                entry = running.get(seq.request_id)
                if entry is not None and entry[0] >= held_out:
                    engine.abort_request(seq.request_id)
                    unstarted.add(seq.request_id)
            say(f"distill: {deadline.left():.1f} s left: no more requests start")
        while order and len(running) < most_queued:
            i = order.popleft()
            params = SamplingParams(
                max_tokens=max_new_tokens, temperature=float(temperatures[i]), seed=seeds[i]
            )
            request_id = f"distill-{i}"
            engine.add_request(request_id, engine.prepare_prompt(None, list(jobs[i][2]), params), params)
            running[request_id] = (i, [])
            kind = "greedy" if params.greedy else "sampled"
        if deadline is not None and not aborted and deadline.left() <= 0:
            for request_id, (i, _) in running.items():
                if i >= held_out and request_id not in unstarted:
                    engine.abort_request(request_id)
            aborted = True
            say("distill: the deadline: the requests still running are dropped")
        if not running:
            break
        deltas = engine.step()
        now = time.monotonic()
        step_seconds = now - last if not step_seconds else 0.9 * step_seconds + 0.1 * (now - last)
        last = now
        for delta in deltas:
            entry = running.get(delta.request_id)
            if entry is None:
                continue
            i, tokens = entry
            tokens.extend(delta.new_token_ids)
            if not delta.finished:
                continue
            del running[delta.request_id]
            if delta.request_id in unstarted:
                stats.unanswered += 1
            elif delta.finish_reason == "abort":
                stats.aborted += 1
            elif delta.finish_reason in ("stop", "length"):
                pid, domain, prompt_ids = jobs[i]
                on_record(i, DistillRecord(pid, domain, float(temperatures[i]), list(prompt_ids), tokens))
                stats.answered += 1
                stats.tokens += len(tokens)
            else:
                stats.failed += 1
                say(f"distill: prompt {jobs[i][0]} failed: {delta.error}")
        progress.tick(
            f", {len(running)} in flight, feeding {kind}" if order else f", {len(running)} in flight"
        )
    while engine.has_unfinished_requests():  # a step launched ahead of requests that ended
        engine.step()
    progress.tick(_ending(stats), final=True)
    return stats


def answer_dense(
    model: CausalLM,
    jobs: Sequence[Job],
    temperatures: Sequence[float],
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    batch_size: int,
    on_record: OnRecord,
    seed: int = 0,
    deadline: Deadline | None = None,
    held_out: int = 0,
) -> FeedStats:
    """Answer `jobs` in padded batches over a dense KV cache (`generate_batch`), the held-out jobs
    first, then the rest by prompt length so little of a batch is padding; each answer goes to
    `on_record` when its batch ends. No batch but a held-out one starts unless the deadline leaves it
    the time the last batch took (and a quarter more)."""
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    rest = sorted(range(held_out, len(jobs)), key=lambda i: len(jobs[i][2]))
    batches = [list(range(held_out))[k : k + batch_size] for k in range(0, held_out, batch_size)]
    batches += [rest[k : k + batch_size] for k in range(0, len(rest), batch_size)]
    stats = FeedStats()
    progress = _Progress(stats, len(jobs))
    last_seconds = 0.0
    for n, rows in enumerate(batches):
        if deadline is not None and rows[0] >= held_out and deadline.left() < 1.25 * last_seconds:
            stats.unanswered = sum(len(b) for b in batches[n:])
            break
        began = time.monotonic()
        ids, temps = [jobs[i][2] for i in rows], [temperatures[i] for i in rows]
        responses = generate_batch(model, ids, max_new_tokens, temps, eos_token_ids, generator)
        last_seconds = time.monotonic() - began
        for i, response in zip(rows, responses, strict=True):
            pid, domain, prompt_ids = jobs[i]
            on_record(i, DistillRecord(pid, domain, float(temperatures[i]), list(prompt_ids), response))
            stats.answered += 1
            stats.tokens += len(response)
        progress.tick(f", batch {n + 1}/{len(batches)}")
    progress.tick(_ending(stats), final=True)
    return stats


def _ending(stats: FeedStats) -> str:
    """What a run's last progress line adds: what the deadline cut."""
    parts = [f"{stats.aborted} aborted at the deadline"] if stats.aborted else []
    parts += [f"{stats.unanswered} never started"] if stats.unanswered else []
    parts += [f"{stats.failed} failed"] if stats.failed else []
    return f" ({', '.join(parts)})" if parts else ""
