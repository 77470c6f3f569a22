"""The verify planner on the device: rank every admissible draft, score each top-K budget, split it.

Drafts (r, j) with j < max_lens[r] are ranked by survival descending, ties by position j then request
r (flat index j * R + r ascending), exactly as dspark.spec.planner ranks them. Instead of a sort, each
draft's rank is the number of admissible drafts ranked before it, and the cumulative survival at that
rank is the sum over that same set, computed pairwise (N = R * block_size is at most a few thousand). The
sums over "ranked before e" and "ranked up to e'" are the same masked reduction when e' precedes e
directly, so the objective at every budget is computed once, consistently, in fp64.

Objective at budget k: (R + sum of the top-k survivals) * SPS(R + k), SPS interpolated linearly in a
table of (tokens, steps/s) points and clamped outside it. The sync budget is the number of leading
admissions that each strictly improve it; the argmax budget its first maximum over k = 0..N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import INTERPRET, next_pow2

# The pairwise tile is [BLOCK_E, BLOCK_F] in fp64: kept small on the GPU so that it stays in registers;
# the interpreter prefers few large steps.
BLOCK_E = 64 if INTERPRET else 32
BLOCK_F = 256 if INTERPRET else 64


@triton.jit
def _sps_at(n, xs_ptr, ys_ptr, num_points, BLOCK_T: tl.constexpr):
    """SPS at token counts n [BLOCK] (fp64), as SpsTable.at computes it."""
    offs_t = tl.arange(0, BLOCK_T)
    xs = tl.load(xs_ptr + offs_t, mask=offs_t < num_points, other=float("inf"))
    x_first = tl.load(xs_ptr)
    x_last = tl.load(xs_ptr + num_points - 1)
    n = tl.minimum(tl.maximum(n, x_first), x_last)
    below = tl.sum((xs[None, :] <= n[:, None]).to(tl.int32), 1)
    i = tl.minimum(tl.maximum(below - 1, 0), tl.maximum(num_points - 2, 0))
    i_next = tl.minimum(i + 1, num_points - 1)
    x0 = tl.load(xs_ptr + i)
    x1 = tl.load(xs_ptr + i_next)
    y0 = tl.load(ys_ptr + i)
    y1 = tl.load(ys_ptr + i_next)
    # A one-point table has x1 == x0; its value is ys[-1] below, so only keep the division finite.
    inside = y0 + (y1 - y0) * (n - x0) / tl.where(x1 > x0, x1 - x0, 1.0)
    return tl.where(n >= x_last, tl.load(ys_ptr + num_points - 1), inside)


@triton.jit
def _rank_kernel(
    surv_ptr,
    max_lens_ptr,
    xs_ptr,
    ys_ptr,
    rank_ptr,
    obj_ptr,
    prev_ptr,
    num_requests,
    block_size,
    num_points,
    stride_s,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(R * block_size, BLOCK_E),); survivals [R, block_size]; max_lens [R]; xs, ys
    [num_points] fp64. For flat draft e = j * R + r: rank[e] (-1 if inadmissible), obj[e] the
    objective at budget rank + 1 and prev[e] at budget rank, fp64."""
    total = num_requests * block_size
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < total
    r_e = e % num_requests
    j_e = e // num_requests
    s_e = tl.load(surv_ptr + r_e * stride_s + j_e, mask=e_ok, other=0.0).to(tl.float64)
    adm_e = e_ok & (j_e < tl.load(max_lens_ptr + r_e, mask=e_ok, other=0))
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.float64)
    upto = tl.zeros([BLOCK_E], dtype=tl.float64)
    for f0 in range(0, total, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        f_ok = f < total
        r_f = f % num_requests
        j_f = f // num_requests
        s_f = tl.load(surv_ptr + r_f * stride_s + j_f, mask=f_ok, other=0.0).to(tl.float64)
        adm_f = f_ok & (j_f < tl.load(max_lens_ptr + r_f, mask=f_ok, other=0))
        ahead = (s_f[None, :] > s_e[:, None]) | ((s_f[None, :] == s_e[:, None]) & (f[None, :] < e[:, None]))
        ahead = ahead & adm_f[None, :]
        rank += tl.sum(ahead.to(tl.int32), 1)
        before += tl.sum(tl.where(ahead, s_f[None, :], 0.0), 1)
        upto += tl.sum(tl.where(ahead | (f[None, :] == e[:, None]), s_f[None, :], 0.0), 1)
    base = tl.cast(num_requests, tl.float64)
    tokens = base + rank.to(tl.float64)
    obj = (base + upto) * _sps_at(tokens + 1.0, xs_ptr, ys_ptr, num_points, BLOCK_T)
    prev = (base + before) * _sps_at(tokens, xs_ptr, ys_ptr, num_points, BLOCK_T)
    tl.store(rank_ptr + e, tl.where(adm_e, rank, -1), mask=e_ok)
    tl.store(obj_ptr + e, obj, mask=e_ok)
    tl.store(prev_ptr + e, prev, mask=e_ok)


@triton.jit
def _split_kernel(
    rank_ptr,
    obj_ptr,
    prev_ptr,
    budget_ptr,
    lens_ptr,
    sync_ptr,
    argmax_ptr,
    num_requests,
    block_size,
    HAS_BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Grid (1,). Budgets from the ranked objective, then verify lens [R]: each request's drafts ranked
    below the budget (sync, or the given budget clamped to the admissible count if >= 0)."""
    total = num_requests * block_size
    big = total + 1
    admitted = 0
    sync = big
    best = tl.full((), float("-inf"), tl.float64)
    best_k = big
    obj0 = tl.full((), float("-inf"), tl.float64)
    for e0 in range(0, total, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        rank = tl.load(rank_ptr + e, mask=e < total, other=-1)
        adm = rank >= 0
        obj = tl.load(obj_ptr + e, mask=adm, other=float("-inf"))
        prev = tl.load(prev_ptr + e, mask=adm, other=float("-inf"))
        admitted += tl.sum(adm.to(tl.int32), 0)
        sync = tl.minimum(sync, tl.min(tl.where(adm & ~(obj > prev), rank, big), 0))
        # prev of the top-ranked draft is the objective of budget 0.
        obj0 = tl.maximum(obj0, tl.max(tl.where(adm & (rank == 0), prev, float("-inf")), 0))
        block_best = tl.max(obj, 0)
        block_k = tl.min(tl.where(adm & (obj == block_best), rank + 1, big), 0)
        best_k = tl.where(
            block_best > best, block_k, tl.where(block_best == best, tl.minimum(best_k, block_k), best_k)
        )
        best = tl.maximum(best, block_best)
    sync = tl.minimum(sync, admitted)
    argmax = tl.where((admitted == 0) | (obj0 >= best), 0, best_k)
    if HAS_BUDGET:
        given = tl.load(budget_ptr).to(tl.int32)
        budget = tl.where(given < 0, sync, tl.minimum(given, admitted))
    else:
        budget = sync
    tl.store(sync_ptr, sync.to(tl.int64))
    tl.store(argmax_ptr, argmax.to(tl.int64))
    j = tl.arange(0, BLOCK_G)
    for r0 in range(0, num_requests, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = (r[:, None] < num_requests) & (j[None, :] < block_size)
        rank = tl.load(rank_ptr + j[None, :] * num_requests + r[:, None], mask=ok, other=-1)
        count = tl.sum(((rank >= 0) & (rank < budget)).to(tl.int64), 1)
        tl.store(lens_ptr + r, count, mask=r < num_requests)


def plan_verify_lens(
    survivals: torch.Tensor,
    max_lens: torch.Tensor,
    sps_tokens: torch.Tensor,
    sps_values: torch.Tensor,
    budget: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify lengths without a host sync (the reference's plan_verify_lens).

    survivals: [R, block_size] float, non-increasing along block_size; max_lens: [R] int; sps_tokens,
    sps_values: [num_points] fp64 (SpsTable points); budget: optional [1] int64 draft budget (the
    lagged policy's; negative means "plan as sync"). Returns (verify_lens [R] int64, sync_budget [1]
    int64, argmax_budget [1] int64). Inputs are not validated (planner._check_inputs does that).
    """
    num_requests, block_size = survivals.shape
    device = survivals.device
    lens, sync, argmax = (
        out
        if out is not None
        else (
            torch.empty(num_requests, dtype=torch.int64, device=device),
            torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(1, dtype=torch.int64, device=device),
        )
    )
    if num_requests == 0 or block_size == 0:
        lens.zero_()
        sync.zero_()
        argmax.zero_()
        return lens, sync, argmax
    survivals = survivals if survivals.stride(-1) == 1 else survivals.contiguous()
    total = num_requests * block_size
    rank = torch.empty(total, dtype=torch.int32, device=device)
    obj = torch.empty(total, dtype=torch.float64, device=device)
    prev = torch.empty(total, dtype=torch.float64, device=device)
    num_points = sps_tokens.shape[0]
    _rank_kernel[(triton.cdiv(total, BLOCK_E),)](
        survivals,
        max_lens,
        sps_tokens,
        sps_values,
        rank,
        obj,
        prev,
        num_requests,
        block_size,
        num_points,
        survivals.stride(0),
        BLOCK_E=BLOCK_E,
        BLOCK_F=BLOCK_F,
        BLOCK_T=next_pow2(num_points),
    )
    _split_kernel[(1,)](
        rank,
        obj,
        prev,
        budget if budget is not None else sync,
        lens,
        sync,
        argmax,
        num_requests,
        block_size,
        HAS_BUDGET=budget is not None,
        BLOCK=1024,
        BLOCK_R=max(16, 1024 // next_pow2(block_size)),
        BLOCK_G=next_pow2(block_size),
        num_warps=8,
    )
    return lens, sync, argmax
