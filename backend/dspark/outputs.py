"""What the engine reports back: per-step deltas and whole completions."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        grow = max(verified - len(self.verified_per_position), 0)
        self.verified_per_position.extend([0] * grow)
        self.accepted_per_position.extend(
            [0] * (len(self.verified_per_position) - len(self.accepted_per_position))
        )
        for k in range(verified):
            self.verified_per_position[k] += 1
        for k in range(accepted):
            self.accepted_per_position[k] += 1

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


@dataclass
class RequestDelta:
    """What one engine step produced for one request: new tokens and text, and whether it ended.

    `finish_reason` is one of "stop", "length", "abort", "error" once `finished` is True.
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

    @classmethod
    def failed(cls, request_id: str, message: str) -> RequestDelta:
        """The last delta of a request that ended on an error."""
        return cls(request_id, [], "", True, "error", 0, 0, SpecStats(), error=message)


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


@dataclass
class EngineLoad:
    """A snapshot of the engine's occupancy, for metrics and health."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
