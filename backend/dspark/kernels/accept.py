"""Acceptance over ragged verify windows: greedy (longest matching prefix + bonus) and lossless
rejection sampling (accept d_i with probability min(1, p_t / p_d), resample the first rejection from
max(0, p_t - p_d), or draw the bonus from p_t when every draft passes).

Random numbers come in as tensors (one uniform per draft position, one Exp(1) row per request), so a
kernel run is a pure function of its inputs and matches the reference twin exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import next_pow2
from dspark.kernels.sampling import BLOCK_V, choose_vocab_splits, race_reduce


@triton.jit
def _greedy_accept_kernel(
    draft_ptr,
    target_ptr,
    cu_ptr,
    lens_ptr,
    caps_ptr,
    accepted_ptr,
    bonus_ptr,
    num_requests,
    stride_d,
    HAS_CAPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_R),); draft [R, block_size]; target [num_window_tokens] packed by cu [R + 1];
    lens, caps [R]; accepted, bonus [R] int64."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_G)
    r_ok = r < num_requests
    start = tl.load(cu_ptr + r, mask=r_ok, other=0).to(tl.int64)
    length = tl.load(lens_ptr + r, mask=r_ok, other=0).to(tl.int32)
    in_window = r_ok[:, None] & (j[None, :] < length[:, None])
    draft = tl.load(draft_ptr + r.to(tl.int64)[:, None] * stride_d + j[None, :], mask=in_window, other=0)
    target = tl.load(target_ptr + start[:, None] + j[None, :], mask=in_window, other=0)
    miss = in_window & (draft != target)
    accepted = tl.min(tl.where(miss, j[None, :], length[:, None]), 1)
    if HAS_CAPS:
        accepted = tl.minimum(accepted, tl.load(caps_ptr + r, mask=r_ok, other=0).to(tl.int32))
    bonus = tl.load(target_ptr + start + accepted, mask=r_ok, other=0)
    tl.store(accepted_ptr + r, accepted.to(tl.int64), mask=r_ok)
    tl.store(bonus_ptr + r, bonus.to(tl.int64), mask=r_ok)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    commit_caps: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over ragged windows (the reference's greedy_accept).

    draft_tokens: [R, block_size]; target_tokens: [num_window_tokens] target argmax per window position,
    packed by cu_windows [R + 1] (window r: 1 + verify_lens[r] positions); commit_caps: [R] optional
    most drafts to commit. Returns (num_accepted [R] int64, bonus [R] int64): the bonus is the target's
    token right after the (capped) accepted prefix.
    """
    num_requests, block_size = draft_tokens.shape
    device = draft_tokens.device
    accepted, bonus = (
        out
        if out is not None
        else (
            torch.empty(num_requests, dtype=torch.int64, device=device),
            torch.empty(num_requests, dtype=torch.int64, device=device),
        )
    )
    if num_requests == 0:
        return accepted, bonus
    draft_tokens = draft_tokens if draft_tokens.stride(-1) == 1 else draft_tokens.contiguous()
    block_r = 32
    _greedy_accept_kernel[(triton.cdiv(num_requests, block_r),)](
        draft_tokens,
        target_tokens,
        cu_windows,
        verify_lens,
        commit_caps if commit_caps is not None else verify_lens,
        accepted,
        bonus,
        num_requests,
        draft_tokens.stride(0),
        HAS_CAPS=commit_caps is not None,
        BLOCK_R=block_r,
        BLOCK_G=next_pow2(block_size),
    )
    return accepted, bonus


@triton.jit
def _rejection_partial_kernel(
    draft_tokens_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    cu_ptr,
    lens_ptr,
    uniforms_ptr,
    exps_ptr,
    accepted_ptr,
    part_val_ptr,
    part_idx_ptr,
    part_mass_ptr,
    vocab,
    chunk,
    num_splits,
    stride_dt,
    stride_dpr,
    stride_dpg,
    stride_tp,
    stride_u,
    stride_e,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (R, splits). Finds the first rejected draft n of request r, then races over one vocabulary
    chunk twice: the plain row p_t[n] / E and the residual max(0, p_t[n] - p_d[n]) / E (the latter
    only matters if draft n was rejected). part_* are [R, 2, splits] (plain, residual) and
    part_mass [R, splits] the residual's largest entry; split 0 writes accepted[r] = n."""
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = tl.load(cu_ptr + r).to(tl.int64)
    length = tl.load(lens_ptr + r).to(tl.int32)
    j = tl.arange(0, BLOCK_G)
    in_window = j < length
    draft = tl.load(draft_tokens_ptr + r * stride_dt + j, mask=in_window, other=0).to(tl.int64)
    p = tl.load(target_probs_ptr + (start + j) * stride_tp + draft, mask=in_window, other=0.0)
    q = tl.load(draft_probs_ptr + r * stride_dpr + j * stride_dpg + draft, mask=in_window, other=0.0)
    u = tl.load(uniforms_ptr + r * stride_u + j, mask=in_window, other=0.0)
    # u * q in fp64 is exact for fp32 inputs, so the test u * q < p has no rounding at all.
    keep = u.to(tl.float64) * q.to(tl.float64) < p.to(tl.float64)
    n = tl.min(tl.where(in_window & ~keep, j, length), 0)
    rejected = n < length
    tl.store(accepted_ptr + r, n.to(tl.int64), mask=split == 0)

    v_lo = split * chunk
    v_hi = tl.minimum(v_lo + chunk, vocab)
    t_row = target_probs_ptr + (start + n) * stride_tp
    d_row = draft_probs_ptr + r * stride_dpr + tl.where(rejected, n, 0) * stride_dpg
    e_row = exps_ptr + r * stride_e
    plain = float("-inf")
    plain_idx = vocab
    best = float("-inf")
    best_idx = vocab
    mass = 0.0
    for v_start in range(v_lo, v_hi, BLOCK):
        offs = v_start + tl.arange(0, BLOCK)
        ok = offs < v_hi
        pt = tl.load(t_row + offs, mask=ok, other=0.0)
        # The rejection flag as a vector: the interpreter cannot mix scalar and vector masks.
        pd = tl.load(d_row + offs, mask=ok & ((offs * 0 + n) < length), other=0.0)
        e = tl.load(e_row + offs, mask=ok, other=1.0)
        # Strictly greater on both races: an earlier block keeps a tie (torch argmax takes the first).
        val = tl.where(ok, tl.math.div_rn(pt, e), float("-inf"))
        block_best = tl.max(val, 0)
        better = block_best > plain
        plain_idx = tl.where(better, tl.argmax(val, 0, tie_break_left=True).to(tl.int32) + v_start, plain_idx)
        plain = tl.where(better, block_best, plain)
        residual = tl.maximum(pt - pd, 0.0)
        val = tl.where(ok, tl.math.div_rn(residual, e), float("-inf"))
        block_best = tl.max(val, 0)
        better = block_best > best
        best_idx = tl.where(better, tl.argmax(val, 0, tie_break_left=True).to(tl.int32) + v_start, best_idx)
        best = tl.where(better, block_best, best)
        mass = tl.maximum(mass, tl.max(residual, 0))
    base = r * 2 * num_splits + split
    tl.store(part_val_ptr + base, plain)
    tl.store(part_idx_ptr + base, plain_idx)
    tl.store(part_val_ptr + base + num_splits, best)
    tl.store(part_idx_ptr + base + num_splits, best_idx)
    tl.store(part_mass_ptr + r * num_splits + split, mass)


@triton.jit
def _rejection_reduce_kernel(
    accepted_ptr,
    lens_ptr,
    part_val_ptr,
    part_idx_ptr,
    part_mass_ptr,
    next_ptr,
    num_splits,
    BLOCK_S: tl.constexpr,
):
    """Grid (R,): the residual race if a draft was rejected and the residual has mass, else the plain
    race (bonus draw, or p_t == p_d everywhere so that rejection had probability zero)."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(accepted_ptr + r)
    length = tl.load(lens_ptr + r).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    mass = tl.max(tl.load(part_mass_ptr + r * num_splits + offs, mask=offs < num_splits, other=0.0), 0)
    use_residual = (n < length) & (mass > 0.0)
    which = tl.where(use_residual, 1, 0)
    base = r * 2 * num_splits + which * num_splits
    token = race_reduce(part_val_ptr + base, part_idx_ptr + base, num_splits, BLOCK_S)
    tl.store(next_ptr + r, token.to(tl.int64))


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_windows: torch.Tensor,
    verify_lens: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    num_splits: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling over ragged windows (the reference's rejection_accept).

    draft_tokens: [R, block_size]; draft_probs: [R, block_size, vocab] fp32 the drafter's filtered
    distributions; target_probs: [num_window_tokens, vocab] fp32 the target's filtered distributions,
    packed by cu_windows [R + 1] (window r: 1 + verify_lens[r] rows); uniforms: [R, block_size]
    U(0, 1); exponentials: [R, vocab] Exp(1). Returns (num_accepted [R] int64, next_token [R] int64).
    """
    num_requests, block_size = draft_tokens.shape
    vocab = target_probs.shape[1]
    device = target_probs.device
    accepted, next_token = (
        out
        if out is not None
        else (
            torch.empty(num_requests, dtype=torch.int64, device=device),
            torch.empty(num_requests, dtype=torch.int64, device=device),
        )
    )
    if num_requests == 0:
        return accepted, next_token
    for name, t in (
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
        ("exponentials", exponentials),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"rejection_accept: {name} must have a unit vocabulary stride")
    draft_tokens = draft_tokens if draft_tokens.stride(-1) == 1 else draft_tokens.contiguous()
    uniforms = uniforms if uniforms.stride(-1) == 1 else uniforms.contiguous()
    splits = num_splits or choose_vocab_splits(num_requests, vocab, device)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK_V) * BLOCK_V
    part_val = torch.empty(num_requests, 2, splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(num_requests, 2, splits, dtype=torch.int32, device=device)
    part_mass = torch.empty(num_requests, splits, dtype=torch.float32, device=device)
    _rejection_partial_kernel[(num_requests, splits)](
        draft_tokens,
        draft_probs,
        target_probs,
        cu_windows,
        verify_lens,
        uniforms,
        exponentials,
        accepted,
        part_val,
        part_idx,
        part_mass,
        vocab,
        chunk,
        splits,
        draft_tokens.stride(0),
        draft_probs.stride(0),
        draft_probs.stride(1),
        target_probs.stride(0),
        uniforms.stride(0),
        exponentials.stride(0),
        BLOCK_G=next_pow2(block_size),
        BLOCK=BLOCK_V,
    )
    _rejection_reduce_kernel[(num_requests,)](
        accepted,
        verify_lens,
        part_val,
        part_idx,
        part_mass,
        next_token,
        splits,
        BLOCK_S=next_pow2(splits),
    )
    return accepted, next_token
