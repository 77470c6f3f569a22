"""The DSpark step as a sequence of values (docs/step_pipeline.md walks one request through it).

    StepSchedule  --draft-->  Drafts  --VerifyPolicy.plan-->  VerifyPlan  --pack_step-->  PackedStep
      --runner.run-->  TargetResult (a LaunchedStep, until accepted)  --accept-->  Acceptance
      --LLMEngine._commit-->  [Committed]

Each stage is a function (or one method of a small object) that takes earlier values and returns a
new frozen one; nothing fills in a field of another stage's value. The values made per request and
step (`WindowAcceptance`, `Committed`) are named tuples: as immutable, and made in under half a
frozen dataclass's time (~0.35 against ~0.77 us; at 256 requests a step each was ~0.1 ms of the host's
step). The values of the speculative part live in `dspark.spec` (`Drafts`, `InStepDrafts`,
`VerifyPlan`), the target step's in `dspark.runner.model_runner` (`TargetStep`, `TargetResult`); this
module holds the packing of a step and its acceptance, which read all of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, Protocol

import torch

from dspark.engine.scheduler import InFlight, StepSchedule
from dspark.runner.deferred_inputs import DeferredInputs
from dspark.runner.model_runner import TargetResult, TargetStep
from dspark.sampling.sampler import choose_tokens
from dspark.sequence import Sequence
from dspark.spec.accept import (
    GreedyAcceptance,
    QueuedGreedyAcceptance,
    queue_greedy_accept,
    rejection_accept_all,
)
from dspark.spec.drafts import Drafts
from dspark.spec.step_draft import InStepDrafts
from dspark.spec.verify_policy import VerifyPlan


class EarlierOutputs(Protocol):
    """What a step packed before the one ahead of it is accepted takes from that one: per output, the
    drafts accepted and the last token committed, on the device (`QueuedGreedyAcceptance`, or the
    steps of a burst so far, `dspark.engine.burst.StepOutputs`)."""

    def per_output(self) -> tuple[torch.Tensor | None, torch.Tensor]: ...


@dataclass(frozen=True)
class PackedStep:
    """One step's target input: every decoding request's verify window [anchor, d_1 .. d_l] (the
    drafts packed in by the runner, see `TargetStep.drafts`), then the prefill chunks; and where each
    window's logit rows start among the rows the runner returns."""

    step: TargetStep
    logit_offsets: tuple[int, ...]


def pack_step(
    schedule: StepSchedule,
    plan: VerifyPlan,
    capture_layers: tuple[int, ...],
    in_flight: InFlight | None = None,
    earlier: EarlierOutputs | None = None,
    fp32_logits: bool = True,
) -> PackedStep:
    """Lay the schedule's windows out back to back as the runner (and every TP rank) takes them.

    Verify windows hold their anchor and placeholders: the drafts are packed in where they are
    (`VerifyDrafts.pack`), so nothing waits here to read them back. Verify windows want the logits of
    every row, a prefill chunk that ends its prompt those of its last row, other chunks none.

    `in_flight`, `earlier`: the step before, launched and not yet accepted, and its greedy acceptance
    queued on the device. A request whose next anchor it commits (a verify window's last token, a
    prompt's first) starts here where it leaves it at least, and its start and anchor are completed on
    the device (`DeferredInputs`). `fp32_logits`: False when every request decides its tokens by the
    argmax alone (`TargetStep.fp32_logits`)."""
    windows = _Windows()
    following: list[tuple[int, int, int]] = []  # (window, anchor row, output of the earlier step)
    advance = in_flight.advance if in_flight is not None else {}
    follows = in_flight.follows if in_flight is not None else {}
    in_order = True  # window j follows output j of the earlier step, for every j
    decode = schedule.decode
    starts = [seq.num_cached + advance.get(seq, 0) for seq in decode]
    windows.add_verify_windows(decode, plan.verify_lens, starts)
    if follows:
        for r, seq in enumerate(decode):
            earlier_output = follows.get(seq)
            if earlier_output is not None:
                in_order = in_order and r == earlier_output == len(following)
                following.append((r, windows.logit_offsets[r], earlier_output))
    for chunk in schedule.prefill:
        seq = chunk.seq
        tokens = seq.token_ids[chunk.start : chunk.start + chunk.length]
        windows.add_chunk(seq, tokens, chunk.start, chunk.samples_first_token)
    deferred = None
    if following:
        assert earlier is not None, "windows follow a step whose acceptance is not queued"
        index = torch.tensor(following, dtype=torch.long).T.contiguous()
        deferred = DeferredInputs(index, *earlier.per_output(), in_order=in_order)
    # A plain decode step (no draft verified, no prompt chunk) keeps its features for the drafter's next
    # block, where it runs eagerly (`TargetStep.keep_features`).
    keep = plan.drafts is None and not schedule.prefill
    step = windows.to_step(capture_layers, plan.drafts, deferred, fp32_logits, keep)
    return PackedStep(step, tuple(windows.logit_offsets))


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose target work is queued on the device, not yet accepted: what accepting it needs."""

    schedule: StepSchedule
    plan: VerifyPlan
    packed: PackedStep
    result: TargetResult

    @property
    def drafts(self) -> Drafts | None:
        """The drafts it verifies (`verified_drafts`)."""
        return verified_drafts(self.plan, self.result)


def verified_drafts(plan: VerifyPlan, result: TargetResult) -> Drafts | None:
    """The drafts the step verified: the plan's, or those the target step made (`InStepDrafts`)."""
    if isinstance(plan.drafts, InStepDrafts):
        assert isinstance(result.drafts, Drafts), "the target step made no drafts"
        return result.drafts
    return plan.drafts


class WindowAcceptance(NamedTuple):
    """One verify window's outcome: the drafts accepted, and the tokens it commits (those drafts,
    then the token after them)."""

    accepted: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Acceptance:
    """What a step commits: per decoding request its window's outcome, and per prefill chunk the first
    token it samples (None for a chunk that does not end its prompt)."""

    windows: tuple[WindowAcceptance, ...]
    first_tokens: tuple[int | None, ...]


def queue_greedy(
    plan: VerifyPlan,
    drafts: Drafts | None,
    result: TargetResult,
    bounds: torch.Tensor | None = None,
    copy: bool = True,
) -> QueuedGreedyAcceptance:
    """The greedy acceptance of every verify window, queued on the device (`accept` reads it); bounds,
    copy: as `queue_greedy_accept` takes them (a burst's steps share one plan's bounds and one copy)."""
    assert result.argmax is not None
    tokens = drafts.tokens if drafts is not None else None
    return queue_greedy_accept(plan.verify_lens, plan.commit_caps, tokens, result.argmax, bounds, copy)


def accept(
    schedule: StepSchedule,
    plan: VerifyPlan,
    drafts: Drafts | None,
    result: TargetResult,
    logit_offsets: Seq[int],
    block_size: int,
    queued: QueuedGreedyAcceptance | None = None,
) -> Acceptance:
    """Decide the committed tokens of every window: greedy requests by the argmax, sampling requests
    by rejection sampling (both on the runner's device, one copy to the host each), and the first
    token of every prefill chunk that ends its prompt. Random numbers are drawn in a fixed order:
    the sampling windows' (in request order), then the first tokens'. `queued`: the greedy
    acceptance, queued already (`queue_greedy`)."""
    logits, argmax = result.logits, result.argmax
    assert logits is not None and argmax is not None
    decode = schedule.decode
    greedy = (queued or queue_greedy(plan, drafts, result)).result()
    sampled = _sampled_accept(decode, plan, drafts, greedy, logits, logit_offsets, block_size)
    outcomes = zip(greedy.accepted, greedy.bonus, greedy.drafts, strict=True)  # one per decode window
    if sampled:  # sampling requests take rejection sampling's outcome
        outcomes = (
            (*sampled[r], verified) if r in sampled else (accepted, next_token, verified)
            for r, (accepted, next_token, verified) in enumerate(outcomes)
        )
    # One comprehension (it runs per request on every step); a window that accepted nothing commits
    # its next token alone.
    windows = [
        WindowAcceptance(accepted, (*verified[:accepted], next_token) if accepted else (next_token,))
        for accepted, next_token, verified in outcomes
    ]
    first_prefill_row = logit_offsets[len(decode)] if schedule.prefill else 0
    first_tokens: list[int | None] = []
    for i, chunk in enumerate(schedule.prefill):
        seq = chunk.seq
        offset = logit_offsets[len(decode) + i]
        if not chunk.samples_first_token:
            first_tokens.append(None)
        elif seq.params.greedy:
            first_tokens.append(greedy.rest[offset - first_prefill_row])
        else:
            first_tokens.append(int(choose_tokens(logits[offset][None], seq.params, seq.generator)[0]))
    return Acceptance(tuple(windows), tuple(first_tokens))


def _sampled_accept(
    decode: Seq[Sequence],
    plan: VerifyPlan,
    drafts: Drafts | None,
    greedy: GreedyAcceptance,
    logits: torch.Tensor,
    logit_offsets: Seq[int],
    block_size: int,
) -> dict[int, tuple[int, int]]:
    """Rejection sampling of every sampling request's window (up to its commit cap), in one call
    where the logits are: {decode row: (drafts kept, next token)}. The drafts verified come from the
    greedy acceptance's copy to the host."""
    rows = [r for r, seq in enumerate(decode) if not seq.params.greedy]
    if not rows:
        return {}
    limits = [plan.commit_caps[r] for r in rows]
    probs = [drafts.probs[r] if drafts is not None else None for r in rows]
    offsets = [logit_offsets[r] for r in rows]
    accepted, next_tokens = rejection_accept_all(
        [greedy.drafts[r][:n] for r, n in zip(rows, limits, strict=True)],
        probs,
        [logits[o : o + n + 1] for o, n in zip(offsets, limits, strict=True)],
        [decode[r].params for r in rows],
        [decode[r].generator for r in rows],
        block_size,
    )
    return {r: (a, t) for r, a, t in zip(rows, accepted, next_tokens, strict=True)}


class Committed(NamedTuple):
    """One request's tokens committed this step, and the logit row of the first of them."""

    seq: Sequence
    tokens: tuple[int, ...]
    logit_row: int


class _Windows:
    """The packed target batch of one step, built window by window (`pack_step`'s scratch)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pages: list[list[int]] = []
        self.starts: list[int] = []
        self.lens: list[int] = []
        self.logit_offsets: list[int] = []
        # Logit rows: every row of the leading windows that want them all (the verify windows), then
        # the rows listed (kept as a count, not a list, since most steps have nothing else).
        self.num_leading_rows = 0
        self.logit_rows: list[int] = []

    def add_verify_windows(self, seqs: Seq[Sequence], verify_lens: Seq[int], starts: list[int]) -> None:
        """Lay out every decoding request's verify window [anchor, verify_lens[r] placeholders] at
        positions starts[r].., first in the step: every row of them wants logits. (All at once, in
        comprehensions: this runs per request on every step.)"""
        assert not self.tokens, "verify windows lead the step"
        anchors = [seq.token_ids[-1] for seq in seqs]
        if any(verify_lens):
            self.logit_offsets = list(accumulate((n + 1 for n in verify_lens), initial=0))
            self.num_leading_rows = self.logit_offsets.pop()
            self.tokens = [0] * self.num_leading_rows
            for offset, anchor in zip(self.logit_offsets, anchors, strict=True):
                self.tokens[offset] = anchor
            self.lens = [n + 1 for n in verify_lens]
        else:  # a plain step: one row a window
            self.tokens, self.lens = anchors, [1] * len(anchors)
            self.logit_offsets, self.num_leading_rows = list(range(len(anchors))), len(anchors)
        self.pages = [seq.pages for seq in seqs]
        self.starts = starts

    def add_chunk(self, seq: Sequence, tokens: list[int], start: int, last_row: bool) -> None:
        """Append a prefill chunk of `tokens` at positions start.. of `seq`, after the verify windows;
        `last_row`: the chunk ends its prompt and its last row's logits are wanted."""
        first = len(self.tokens)
        self.logit_offsets.append(self.num_leading_rows + len(self.logit_rows))
        self.tokens.extend(tokens)
        self.pages.append(seq.pages)
        self.starts.append(start)
        self.lens.append(len(tokens))
        if last_row:
            self.logit_rows.append(first + len(tokens) - 1)

    def to_step(
        self,
        capture_layers: tuple[int, ...],
        drafts: Drafts | InStepDrafts | None,
        deferred: DeferredInputs | None = None,
        fp32_logits: bool = True,
        keep_features: bool = False,
    ) -> TargetStep:
        """The packed batch as the runner (and every TP rank) takes it."""
        rows = torch.arange(self.num_leading_rows)
        if self.logit_rows:
            rows = torch.cat([rows, torch.tensor(self.logit_rows, dtype=torch.long)])
        return TargetStep(
            token_ids=torch.tensor(self.tokens, dtype=torch.long),
            positions=None,  # laid out where the step runs (from each window's start)
            window_starts=self.starts,
            window_lens=self.lens,
            pages=self.pages,
            logit_rows=rows,
            capture_layers=capture_layers,
            host_logits=False,
            drafts=drafts,
            deferred=deferred,
            fp32_logits=fp32_logits,
            keep_features=keep_features,
        )
