"""Building the packed step batch on the device: window boundaries, positions, cache slots and the
verify tokens. No per-request host work.

Token t of the packed batch belongs to the window r with cu[r] <= t < cu[r + 1] (binary search over
cu); rows past cu[R] are padding (a CUDA-graph token tier larger than the batch): position 0, slot -1
(every store kernel skips negative slots), token 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import find_window, next_pow2

BLOCK_T = 256


@triton.jit
def _window_bounds_kernel(starts_ptr, lens_ptr, cu_ptr, kv_lens_ptr, num_requests, BLOCK_R: tl.constexpr):
    """Grid (1,); starts, lens [R] -> cu [R + 1] int32 (exclusive prefix sum), kv_lens [R] int32."""
    carry = tl.full((), 0, tl.int32)
    tl.store(cu_ptr, carry)
    for r0 in range(0, num_requests, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < num_requests
        length = tl.load(lens_ptr + r, mask=ok, other=0).to(tl.int32)
        start = tl.load(starts_ptr + r, mask=ok, other=0).to(tl.int32)
        ends = carry + tl.cumsum(length, 0)
        tl.store(cu_ptr + 1 + r, ends, mask=ok)
        tl.store(kv_lens_ptr + r, start + length, mask=ok)
        carry = carry + tl.sum(length, 0)


@triton.jit
def _positions_slots_kernel(
    starts_ptr,
    cu_ptr,
    page_table_ptr,
    positions_ptr,
    slots_ptr,
    num_requests,
    num_tokens,
    search_steps,
    stride_pt,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK),); positions [T] int64 = start[r] + (t - cu[r]); slots [T] int64 from the
    page table [R, max_pages]."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < num_tokens
    real = t_ok & (t < tl.load(cu_ptr + num_requests))
    r = find_window(cu_ptr, num_requests, t, search_steps, 1)
    position = tl.load(starts_ptr + r, mask=real, other=0).to(tl.int64) + (
        t - tl.load(cu_ptr + r, mask=real, other=0)
    )
    position = tl.where(real, position, 0)
    page = tl.load(page_table_ptr + r.to(tl.int64) * stride_pt + position // PAGE_SIZE, mask=real, other=0)
    slot = tl.where(real, page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE, -1)
    tl.store(positions_ptr + t, position, mask=t_ok)
    tl.store(slots_ptr + t, slot, mask=t_ok)


def build_window_layout(
    window_starts: torch.Tensor,
    window_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    num_tokens: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed layout of R windows (the reference's build_window_layout).

    window_starts, window_lens: [R] int (window r covers positions [start, start + len) of request r);
    page_table: [R, max_pages] int32; num_tokens: packed rows to fill (>= sum of lens; the rest is
    padding). Returns (positions [num_tokens] int64, slots [num_tokens] int64, cu_seqlens [R + 1] int32,
    kv_lens [R] int32), the AttentionBatch fields.
    """
    num_requests = window_lens.shape[0]
    device = window_lens.device
    positions, slots, cu, kv_lens = (
        out
        if out is not None
        else (
            torch.empty(num_tokens, dtype=torch.int64, device=device),
            torch.empty(num_tokens, dtype=torch.int64, device=device),
            torch.empty(num_requests + 1, dtype=torch.int32, device=device),
            torch.empty(num_requests, dtype=torch.int32, device=device),
        )
    )
    if num_requests == 0:
        cu.zero_()
        positions.zero_()
        slots.fill_(-1)
        return positions, slots, cu, kv_lens
    _window_bounds_kernel[(1,)](
        window_starts, window_lens, cu, kv_lens, num_requests, BLOCK_R=min(1024, next_pow2(num_requests))
    )
    if num_tokens:
        _positions_slots_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
            window_starts,
            cu,
            page_table,
            positions,
            slots,
            num_requests,
            num_tokens,
            num_requests.bit_length(),
            page_table.stride(0),
            PAGE_SIZE=page_size,
            BLOCK=BLOCK_T,
        )
    return positions, slots, cu, kv_lens


@triton.jit
def _verify_tokens_kernel(
    anchors_ptr,
    drafts_ptr,
    cu_ptr,
    tokens_ptr,
    num_requests,
    num_tokens,
    search_steps,
    stride_d,
    BLOCK: tl.constexpr,
    KEEP_PAST_END: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK),); window r = [anchor[r], drafts[r, 0], ..., drafts[r, len - 2]]. Rows
    from cu[R] on are zeroed, or left as they are with KEEP_PAST_END."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < num_tokens
    real = t_ok & (t < tl.load(cu_ptr + num_requests))
    r = find_window(cu_ptr, num_requests, t, search_steps, 1)
    i = t - tl.load(cu_ptr + r, mask=real, other=0)
    anchor = tl.load(anchors_ptr + r, mask=real & (i == 0), other=0)
    draft = tl.load(drafts_ptr + r.to(tl.int64) * stride_d + i - 1, mask=real & (i > 0), other=0)
    keep = real if KEEP_PAST_END else t_ok
    tl.store(tokens_ptr + t, tl.where(i == 0, anchor, draft).to(tl.int64), mask=keep)


def pack_verify_tokens(
    anchors: torch.Tensor,
    drafts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor | None = None,
    keep_past_end: bool = False,
) -> torch.Tensor:
    """Packed verify-window tokens (the reference's pack_verify_tokens).

    anchors: [R]; drafts: [R, block_size]; cu_seqlens: [R + 1] (window r has 1 + verify_len[r] tokens).
    Returns token ids [num_tokens] int64 (padding rows 0; with keep_past_end, `out`'s rows from
    cu_seqlens[R] on are left as they are: no host sync, so a CUDA graph can pack a step's verify
    windows in front of its prompt chunks).
    """
    num_requests = anchors.shape[0]
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=anchors.device)
    if num_tokens == 0:
        return out
    if num_requests == 0:
        return out if keep_past_end else out.zero_()
    drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()
    _verify_tokens_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        anchors,
        drafts,
        cu_seqlens,
        out,
        num_requests,
        num_tokens,
        num_requests.bit_length(),
        drafts.stride(0),
        BLOCK=BLOCK_T,
        KEEP_PAST_END=keep_past_end,
    )
    return out
