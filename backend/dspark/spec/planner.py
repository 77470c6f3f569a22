"""Verify-length planner: how many drafted tokens each request verifies this step, by the rule below
(the plan stage of docs/step_pipeline.md, for the compact and cap-accept policies).

Verifying ``ℓ_r`` drafts of request ``r`` costs ``1 + ℓ_r`` target tokens (anchor included) and is
expected to commit ``1 + Σ_{j≤ℓ_r} a_{r,j}`` tokens, where ``a_{r,j} = c_{r,1}·…·c_{r,j}`` is the
survival of the first ``j`` drafts. With ``B = Σ(1+ℓ_r)`` and ``τ = Σ(1 + Σ_{j≤ℓ_r} a_{r,j})`` the
planner maximizes ``τ · SPS(B)``.

All admissible drafts ``(r, j)`` (``j ≤ max_lens[r]``) are ranked once: survival descending, ties by
position ``j`` ascending, then request ``r`` ascending. Because survivals are non-increasing along
``j``, every leading slice of that ranking is a contiguous prefix of each request's block, so a plan
is just "admit the first K ranked drafts" and the verify lengths are per-request counts.

- ``sync``: K is the number of leading admissions that each strictly improve the objective; the first
  admission that does not stops the scan (no look-ahead: a global argmax over the same step's
  confidences would make the verify length depend on later drafts' confidences, which is not lossless).
- ``lagged``: K is the global argmax budget computed from the survivals of ``lag`` steps earlier.

Shapes: ``survivals`` float ``[R, block_size]``, ``max_lens`` int64 ``[R]``, plans int64 ``[R]``.
"""

from __future__ import annotations

from collections import deque

import torch

from dspark.config import PLANNER_POLICIES
from dspark.kernels import ops, reference
from dspark.spec.sps_table import SpsTable


def _check_inputs(survivals: torch.Tensor, max_lens: torch.Tensor) -> torch.Tensor:
    """Validate shapes and values; return ``max_lens`` as int64 on the survivals' device."""
    if survivals.dim() != 2 or not survivals.is_floating_point():
        raise ValueError(
            f"survivals: must be a float [R, block_size] tensor, got {survivals.dtype} {survivals.shape}"
        )
    num_requests, block_size = survivals.shape
    if max_lens.shape != (num_requests,) or max_lens.is_floating_point() or max_lens.dtype == torch.bool:
        raise ValueError(
            f"max_lens: must be an integer [{num_requests}] tensor, got {max_lens.dtype} {max_lens.shape}"
        )
    max_lens = max_lens.to(device=survivals.device, dtype=torch.int64)
    if num_requests == 0:
        return max_lens
    # Only admissible entries are checked: rows past a request's cap may be padding.
    pos = torch.arange(block_size, device=survivals.device)
    admissible = pos[None, :] < max_lens[:, None]
    next_admissible = admissible[:, 1:]
    bad_range = (max_lens < 0) | (max_lens > block_size)
    bad_value = admissible & ~(torch.isfinite(survivals) & (survivals >= 0))
    increasing = next_admissible & (survivals[:, 1:] > survivals[:, :-1])
    # One host sync for the common (valid) case; the specific message is worked out only on failure.
    if bool(bad_range.any() | bad_value.any() | increasing.any()):
        if bool(bad_range.any()):
            raise ValueError(f"max_lens: every entry must be in [0, {block_size}], got {max_lens.tolist()}")
        if bool(bad_value.any()):
            raise ValueError("survivals: admissible entries must be finite and >= 0")
        raise ValueError("survivals: must be non-increasing along each row (a_j = c_1·…·c_j)")
    return max_lens


def _plan(
    survivals: torch.Tensor, max_lens: torch.Tensor, sps: SpsTable, budget: int | None = None
) -> tuple[torch.Tensor, int, int]:
    """(verify lengths [R], sync budget, argmax budget) by the planner op's torch twin, on the host's
    terms: validated inputs, int budgets (a given budget overrides the sync count for the lengths)."""
    max_lens = _check_inputs(survivals, max_lens)
    device = survivals.device
    given = None if budget is None else torch.tensor([budget], dtype=torch.int64, device=device)
    lens, sync, argmax = reference.plan_verify_lens(survivals, max_lens, *sps.tensors(device), given)
    return lens, int(sync[0]), int(argmax[0])


def global_argmax_budget(survivals: torch.Tensor, max_lens: torch.Tensor, sps: SpsTable) -> int:
    """The draft budget K (0..N admissible) maximizing ``τ·SPS(B)`` over top-K splits; smallest K on ties."""
    return _plan(survivals, max_lens, sps)[2]


def sync_budget(survivals: torch.Tensor, max_lens: torch.Tensor, sps: SpsTable) -> int:
    """The draft budget K the ``sync`` policy admits (scan stops at the first non-improving admission)."""
    return _plan(survivals, max_lens, sps)[1]


def split_budget(survivals: torch.Tensor, max_lens: torch.Tensor, budget: int) -> torch.Tensor:
    """Verify lengths int64 ``[R]`` giving the top-``budget`` admissible drafts (clamped to N) their slots."""
    if budget < 0:
        raise ValueError(f"budget: must be >= 0, got {budget}")
    # With a budget given, the SPS table plays no part in the split.
    return _plan(survivals, max_lens, SpsTable.flat(), budget)[0]


class VerifyPlanner:
    """Chooses per-request verify lengths each step under the ``sync`` or ``lagged`` policy."""

    def __init__(self, policy: str, sps: SpsTable, lag: int = 1) -> None:
        """``lag`` (>= 1) is how many steps earlier the ``lagged`` policy's budget was computed."""
        if policy not in PLANNER_POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(PLANNER_POLICIES)}, got {policy!r}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag: must be an integer >= 1, got {lag!r}")
        self.policy = policy
        self.sps = sps
        self.lag = lag
        self._verify_all = sps.is_flat  # the table never changes, so decide the fast path once
        # Budgets computed from the last `lag` steps' survivals, oldest first.
        self._history: deque[int] = deque(maxlen=lag)

    @property
    def verifies_all(self) -> bool:
        """Whether every plan is the caps themselves (a flat table: more tokens never cost more), so a
        caller may skip planning, and its survivals, altogether."""
        return self._verify_all

    def plan(self, survivals: torch.Tensor, max_lens: torch.Tensor) -> torch.Tensor:
        """Verify lengths int64 ``[R]`` (0..max_lens[r]) from survivals ``[R, block_size]`` and caps ``[R]``,
        on the survivals' device (the planner kernel there on CUDA: ``ops.plan_verify_lens``)."""
        max_lens = _check_inputs(survivals, max_lens)
        if self._verify_all:
            return max_lens.clone()
        device = survivals.device
        budget = None
        if self.policy == "lagged" and len(self._history) == self.lag:
            # The requests (or their caps) may have changed since; the op never admits more than exist.
            budget = torch.tensor([self._history[0]], dtype=torch.int64, device=device)
        # Without a budget the op admits the sync count: the sync policy, and lagged until its history
        # is full.
        lens, _, argmax_budget = ops.plan_verify_lens(survivals, max_lens, *self.sps.tensors(device), budget)
        if self.policy == "lagged":
            self._history.append(int(argmax_budget[0]))
        return lens

    def reset(self) -> None:
        """Forget the lagged budgets (e.g. after the running batch is rebuilt)."""
        self._history.clear()
