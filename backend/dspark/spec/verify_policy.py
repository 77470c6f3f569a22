"""VerifyPolicy: one class per speculation mode (EngineConfig.spec_mode), chosen once from the config.

A step's drafts (`Drafts`, or `InStepDrafts` still to be made inside the target step) become a
`VerifyPlan`: per decoding request, how many drafts the target verifies and how many of those may be
committed. Every mode is lossless; they differ in what they verify:

- `off`: nothing is drafted (no drafter is loaded); every request verifies its anchor alone.
- `static`: every request verifies all the drafts it may (its cap), whatever their confidences; the
  lengths do not depend on the drafts, so they can be drafted inside the target step.
- `compact`: the planner (`spec.planner`) chooses ragged verify lengths from the drafts'
  confidences, and requests stop drafting once their survival falls below `draft_stop_survival`.
  With a flat SPS table (`sps_table` empty, the default) more verified tokens never cost more, so the
  planner's lengths are the caps whatever the confidences and stopping early saves nothing: `compact`
  then drafts whole blocks, inside the target step where it can, as `static` does.
- `cap-accept` (a diagnostic): verify every draft, commit only up to the planned lengths.

Mode names are read here and nowhere else: the rest of the engine asks its policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.config import EngineConfig
from dspark.spec.drafts import Drafts
from dspark.spec.planner import VerifyPlanner
from dspark.spec.step_draft import InStepDrafts


@dataclass(frozen=True)
class VerifyPlan:
    """Per decoding request (in the schedule's order): the drafts it verifies (`verify_lens`, its
    window is 1 + that many tokens) and the most of them that may be committed (`commit_caps`); and
    the drafts themselves (None: a plain step, nothing drafted)."""

    verify_lens: tuple[int, ...]
    commit_caps: tuple[int, ...]
    drafts: Drafts | InStepDrafts | None

    @classmethod
    def plain(cls, num_requests: int) -> VerifyPlan:
        """Every request verifies its anchor alone: no drafts."""
        zeros = (0,) * num_requests
        return cls(zeros, zeros, None)


class VerifyPolicy(Protocol):
    """How one speculation mode drafts and turns a step's drafts into a `VerifyPlan`."""

    @property
    def draft_stop_survival(self) -> float:
        """The survival below which a request stops drafting (0: it drafts whole blocks)."""
        ...

    @property
    def drafts_in_step(self) -> bool:
        """Whether verify lengths are fixed before drafting, so the drafts may be made inside the
        target step (`InStepDrafts`)."""
        ...

    @property
    def uses_planner(self) -> bool:
        """Whether plans read the planner (and so its SPS table, worth profiling at start-up)."""
        ...

    def plan(self, drafts: Drafts | InStepDrafts, caps: list[int], planner: VerifyPlanner) -> VerifyPlan:
        """The plan of a step whose decoding requests drafted `drafts` and may verify up to `caps[r]`
        drafts each (at most the block size)."""
        ...


@dataclass(frozen=True)
class OffPolicy:
    """`off`: no speculation; every step is plain (the engine loads no drafter)."""

    draft_stop_survival: float = 0.0
    drafts_in_step: bool = False
    uses_planner: bool = False

    def plan(self, drafts: Drafts | InStepDrafts, caps: list[int], planner: VerifyPlanner) -> VerifyPlan:
        return VerifyPlan.plain(len(caps))


@dataclass(frozen=True)
class StaticPolicy:
    """`static`: every request verifies its whole cap."""

    draft_stop_survival: float = 0.0
    drafts_in_step: bool = True
    uses_planner: bool = False

    def plan(self, drafts: Drafts | InStepDrafts, caps: list[int], planner: VerifyPlanner) -> VerifyPlan:
        # Drafts made apart may be shorter than a cap (a copied block, `spec.lookup`): never verify a
        # position that holds no draft.
        verified = tuple(caps) if isinstance(drafts, InStepDrafts) else drafted_caps(drafts, caps)
        return VerifyPlan(verified, verified, drafts)


@dataclass(frozen=True)
class CompactPolicy:
    """`compact`: verify and commit the planned lengths of what each request drafted (up to its early
    stop at `stop_survival`). `flat_table`: the SPS table is flat, so every plan is the caps whatever the
    confidences: whole blocks are drafted, inside the target step where it can (as `static`)."""

    block_size: int
    stop_survival: float
    flat_table: bool = False

    @property
    def draft_stop_survival(self) -> float:
        # Stopping saves verify rows only where they cost something; with a flat table it would only
        # keep its drafts out of the target step.
        return 0.0 if self.flat_table else self.stop_survival

    @property
    def drafts_in_step(self) -> bool:
        return self.flat_table

    @property
    def uses_planner(self) -> bool:
        return not self.flat_table

    def plan(self, drafts: Drafts | InStepDrafts, caps: list[int], planner: VerifyPlanner) -> VerifyPlan:
        if isinstance(drafts, InStepDrafts):
            assert self.flat_table, "compact plans from drafts made before the step"
            return VerifyPlan(tuple(caps), tuple(caps), drafts)
        lens = planned_lens(drafts, drafted_caps(drafts, caps), planner, self.block_size)
        return VerifyPlan(lens, lens, drafts)


@dataclass(frozen=True)
class CapAcceptPolicy:
    """`cap-accept`: verify everything drafted, commit only up to the planned lengths."""

    block_size: int
    draft_stop_survival: float = 0.0
    drafts_in_step: bool = False
    uses_planner: bool = True

    def plan(self, drafts: Drafts | InStepDrafts, caps: list[int], planner: VerifyPlanner) -> VerifyPlan:
        assert isinstance(drafts, Drafts), "cap-accept plans from drafts made before the step"
        verified = drafted_caps(drafts, caps)
        return VerifyPlan(verified, planned_lens(drafts, verified, planner, self.block_size), drafts)


def drafted_caps(drafts: Drafts, caps: list[int]) -> tuple[int, ...]:
    """The caps, lowered to what each request drafted: positions it did not draft (it stopped early)
    are never verified."""
    if drafts.lengths is None:
        return tuple(caps)
    return tuple(min(cap, int(n)) for cap, n in zip(caps, drafts.lengths.tolist(), strict=True))


def planned_lens(
    drafts: Drafts, caps: tuple[int, ...], planner: VerifyPlanner, block_size: int
) -> tuple[int, ...]:
    """The planner's verify lengths (0..caps[r]) from the survivals a_j = c_1 ... c_j of the first
    `block_size` confidences (the caps themselves when the planner verifies everything)."""
    if planner.verifies_all:
        return caps
    survivals = torch.cumprod(drafts.confidences[:, :block_size], dim=1)
    return tuple(planner.plan(survivals, torch.tensor(caps, dtype=torch.long)).tolist())


def verify_policy(config: EngineConfig, block_size: int, flat_table: bool = False) -> VerifyPolicy:
    """The policy of `config.spec_mode` (block_size: the engine's resolved block size; flat_table: the
    planner's SPS table is flat, known before the engine starts: `sps_table` empty or a flat file)."""
    mode = config.spec_mode
    if mode == "off":
        return OffPolicy()
    if mode == "static":
        return StaticPolicy()
    if mode == "compact":
        return CompactPolicy(block_size, config.draft_stop_survival, flat_table)
    if mode == "cap-accept":
        return CapAcceptPolicy(block_size)
    raise ValueError(f"spec_mode: no verify policy for {mode!r}")
