"""Sequence: the state of one request as the engine decodes it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from dspark.outputs import SpecStats
from dspark.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, its cache pages and its progress.

    Invariant once prefilled: the target (and drafter context) caches hold `num_cached ==
    len(token_ids) - 1` positions; the last token is the anchor, not yet cached.
    """

    request_id: str
    arrival: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    num_preemptions: int = 0
    arrival_step: int = 0  # the engine's steps launched before it came (requests of one wave share it)
    num_prompt_tokens: int = field(init=False, repr=False)  # len(prompt_token_ids), set once

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        # The prompt never changes: its length is read per request on every step (host time at batch 64).
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prefill_target(self) -> int:
        """Positions the cache must hold before decoding: the prompt, or all but the anchor on resume."""
        length = len(self.token_ids)
        return length - 1 if length > self.num_prompt_tokens else length

    @property
    def in_prefill(self) -> bool:
        """True until the cache holds `prefill_target` positions."""
        return self.num_cached < self.prefill_target

    @property
    def anchor(self) -> int:
        """The last committed token, the first of the next verify window."""
        return self.token_ids[-1]

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens `max_tokens` allows."""
        return self.params.max_tokens - self.num_output_tokens

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is SequenceStatus.FINISHED
