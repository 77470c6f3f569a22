"""Exponential-race (Gumbel-max) sampling: token = argmax_v p[v] / E[v], E ~ Exp(1) passed in.

The vocabulary is split over programs (so one or a few rows still fill the GPU); each writes its best
(value, index) and a second kernel reduces them. Ties go to the lowest vocabulary index, as torch's
argmax does, and the division is IEEE round-to-nearest (tl.math.div_rn) so that the kernel and the
reference agree bit for bit on the race values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import next_pow2, num_sms

BLOCK_V = 1024
MIN_CHUNK = 4096


@triton.jit
def race_chunk(p_row_ptr, e_row_ptr, v_lo, v_hi, vocab, BLOCK: tl.constexpr):
    """(max, first argmax) of p / E over vocabulary [v_lo, v_hi) of one row; (-inf, vocab) if empty."""
    best = float("-inf")
    best_idx = vocab
    for start in range(v_lo, v_hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < v_hi
        p = tl.load(p_row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        e = tl.load(e_row_ptr + offs, mask=ok, other=1.0).to(tl.float32)
        val = tl.where(ok, tl.math.div_rn(p, e), float("-inf"))
        block_best = tl.max(val, 0)
        block_idx = tl.argmax(val, 0, tie_break_left=True).to(tl.int32) + start
        # Strictly greater: an earlier block keeps a tie.
        better = block_best > best
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
    return best, best_idx


@triton.jit
def _race_partial_kernel(
    probs_ptr,
    exps_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    chunk,
    num_splits,
    stride_p,
    stride_e,
    BLOCK: tl.constexpr,
):
    """Grid (rows, splits); probs, exps [rows, vocab]; part_val/part_idx [rows, splits]."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    v_lo = split * chunk
    v_hi = tl.minimum(v_lo + chunk, vocab)
    best, best_idx = race_chunk(
        probs_ptr + row * stride_p, exps_ptr + row * stride_e, v_lo, v_hi, vocab, BLOCK
    )
    tl.store(part_val_ptr + row * num_splits + split, best)
    tl.store(part_idx_ptr + row * num_splits + split, best_idx)


@triton.jit
def race_reduce(val_ptr, idx_ptr, num_splits, BLOCK_S: tl.constexpr):
    """Index of the best of num_splits partial (value, index) pairs; ties to the earliest split."""
    offs = tl.arange(0, BLOCK_S)
    ok = offs < num_splits
    vals = tl.load(val_ptr + offs, mask=ok, other=float("-inf"))
    idxs = tl.load(idx_ptr + offs, mask=ok, other=0)
    pick = tl.argmax(vals, 0, tie_break_left=True)
    return tl.sum(tl.where(offs == pick, idxs, 0), 0)


@triton.jit
def _race_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    """Grid (rows,); part_val/part_idx [rows, splits] -> out [rows] int64."""
    row = tl.program_id(0).to(tl.int64)
    token = race_reduce(part_val_ptr + row * num_splits, part_idx_ptr + row * num_splits, num_splits, BLOCK_S)
    tl.store(out_ptr + row, token.to(tl.int64))


def choose_vocab_splits(num_rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary splits: enough programs for about two per multiprocessor, chunks of >= MIN_CHUNK."""
    most = triton.cdiv(vocab, MIN_CHUNK)
    wanted = triton.cdiv(2 * num_sms(device), max(num_rows, 1))
    return max(1, min(most, wanted))


def exponential_race_sample(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row as argmax(p / E) (the reference's exponential_race_sample).

    probs, exponentials: [num_rows, vocab] (unit column stride). Returns [num_rows] int64.
    """
    num_rows, vocab = probs.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows == 0:
        return out
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    exponentials = exponentials if exponentials.stride(-1) == 1 else exponentials.contiguous()
    splits = num_splits or choose_vocab_splits(num_rows, vocab, probs.device)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK_V) * BLOCK_V
    part_val = torch.empty(num_rows, splits, dtype=torch.float32, device=probs.device)
    part_idx = torch.empty(num_rows, splits, dtype=torch.int32, device=probs.device)
    _race_partial_kernel[(num_rows, splits)](
        probs,
        exponentials,
        part_val,
        part_idx,
        vocab,
        chunk,
        splits,
        probs.stride(0),
        exponentials.stride(0),
        BLOCK=BLOCK_V,
    )
    _race_reduce_kernel[(num_rows,)](part_val, part_idx, out, splits, BLOCK_S=next_pow2(splits))
    return out
