"""The greedy Markov decode of a draft block: block_size drafts per request in block_size + 1 launches.

Draft k of request r is argmax_v (U[r, k, v] + W2[v] · W1[x_{k-1}]), where U is the block's base
logits, x_{-1} the anchor and W1, W2 [vocab, rank] the drafter's low-rank Markov head. The torch
form takes about six kernels a position (a gather, a GEMM, two casts, an add, an argmax); here each
position is one launch over (vocabulary tiles, request tiles) that writes every tile's best (value,
index), and the next launch starts by reducing those to the previous token (ties to the lowest
index, as torch.argmax), so no host work and no extra launch sits between positions. A last small
launch reduces the final position.

The correction W2 · m is one tl.dot a tile (bf16 operands on a GPU, fp32 in the interpreter and for
fp32 weights), accumulated in fp32 and rounded to W2's dtype before the add, as the torch form's GEMM
in that dtype does, so drafts differ from it only where two logits tie within the sum's rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dot_in_fp32, next_pow2, round_cast

BLOCK_R = 16  # requests a program serves (tl.dot's smallest M)
BLOCK_V = 128  # vocabulary entries a program takes at a time
SUB_TILES = 8  # ... and how many times: a program covers 1024 entries, so the next launch's
# reduction of the partials stays small (48 per request for SmolLM2's vocabulary, 149 for Qwen3's)


@triton.jit
def _previous_tokens(part_val_ptr, part_idx_ptr, rows, row_ok, num_tiles, BLOCK_T: tl.constexpr):
    """[BLOCK_R] tokens: the best of each row's num_tiles partial (value, index) pairs, ties to the
    lowest index."""
    tiles = tl.arange(0, BLOCK_T)
    ok = row_ok[:, None] & (tiles[None, :] < num_tiles)
    offsets = rows.to(tl.int64)[:, None] * num_tiles + tiles[None, :]
    vals = tl.load(part_val_ptr + offsets, mask=ok, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + offsets, mask=ok, other=2147483647)
    best = tl.max(vals, 1)
    return tl.min(tl.where(vals == best[:, None], idxs, 2147483647), 1).to(tl.int64)


@triton.jit
def _markov_step_kernel(
    base_ptr,
    anchors_ptr,
    in_val_ptr,
    in_idx_ptr,
    tokens_ptr,
    w1_ptr,
    w2_ptr,
    out_val_ptr,
    out_idx_ptr,
    num_requests,
    vocab,
    num_tiles,
    position,
    stride_br,
    stride_bg,
    stride_tr,
    RANK: tl.constexpr,
    FIRST: tl.constexpr,
    CORR_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_TILES: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid (num_tiles, cdiv(R, BLOCK_R)): position `position`'s partial argmax over one vocabulary
    tile (SUB_TILES chunks of BLOCK_V entries) for BLOCK_R requests. The previous token is the anchor
    (FIRST) or the reduction of the last launch's partials, which the tile-0 programs also store as
    draft position - 1."""
    tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_requests
    if FIRST:
        previous = tl.load(anchors_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        previous = _previous_tokens(in_val_ptr, in_idx_ptr, rows, row_ok, num_tiles, BLOCK_T)
        if tile == 0:
            tl.store(tokens_ptr + rows.to(tl.int64) * stride_tr + position - 1, previous, mask=row_ok)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < RANK
    # W1[x_{k-1}] [BLOCK_R, rank] (rank padded with zeros), read once for the whole tile.
    m = tl.load(
        w1_ptr + previous[:, None] * RANK + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
    )
    if DOT_FP32:
        m = m.to(tl.float32)
    best = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    best_index = tl.zeros((BLOCK_R,), tl.int32)
    row_base = base_ptr + rows.to(tl.int64)[:, None] * stride_br + position * stride_bg
    for sub in range(SUB_TILES):
        v = (tile * SUB_TILES + sub) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = v < vocab
        w = tl.load(
            w2_ptr + v.to(tl.int64)[:, None] * RANK + kk[None, :],
            mask=v_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            correction = tl.dot(m, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            correction = tl.dot(m, tl.trans(w))
        correction = round_cast(correction, CORR_DTYPE).to(tl.float32)
        ok = row_ok[:, None] & v_ok[None, :]
        base = tl.load(row_base + v[None, :], mask=ok, other=0.0).to(tl.float32)
        logits = tl.where(ok, base + correction, float("-inf"))
        chunk_best = tl.max(logits, 1)
        chunk_index = tl.argmax(logits, 1, tie_break_left=True) + (tile * SUB_TILES + sub) * BLOCK_V
        # Strictly greater: an earlier chunk keeps a tie (the lowest index, as torch.argmax).
        better = chunk_best > best
        best = tl.where(better, chunk_best, best)
        best_index = tl.where(better, chunk_index, best_index)
    tl.store(out_val_ptr + rows.to(tl.int64) * num_tiles + tile, best, mask=row_ok)
    tl.store(out_idx_ptr + rows.to(tl.int64) * num_tiles + tile, best_index, mask=row_ok)


@triton.jit
def _markov_last_kernel(
    in_val_ptr,
    in_idx_ptr,
    tokens_ptr,
    num_requests,
    num_tiles,
    position,
    stride_tr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_R),): the last position's draft from its partials."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_requests
    token = _previous_tokens(in_val_ptr, in_idx_ptr, rows, row_ok, num_tiles, BLOCK_T)
    tl.store(tokens_ptr + rows.to(tl.int64) * stride_tr + position, token, mask=row_ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def markov_decode(
    base_logits: torch.Tensor,
    anchors: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy Markov decode of every request's block (the reference's markov_decode).

    base_logits: [R, block_size, vocab] (unit vocabulary stride, any float dtype); anchors: [R]; w1, w2:
    [vocab, rank] (the correction is rounded to w2's dtype). Returns drafts [R, block_size] int64.
    """
    num_requests, block_size, vocab = base_logits.shape
    rank = w1.shape[1]
    device = base_logits.device
    tokens = (
        out if out is not None else torch.empty(num_requests, block_size, dtype=torch.int64, device=device)
    )
    if num_requests == 0 or block_size == 0:
        return tokens
    if base_logits.stride(-1) != 1:
        raise ValueError("markov_decode: base_logits must have a unit vocabulary stride")
    if w1.dtype != w2.dtype:
        raise ValueError("markov_decode: w1 and w2 must share a dtype")
    if tokens.stride(1) != 1:
        raise ValueError("markov_decode: out must have a unit position stride")
    # The proposer's anchors are a strided view (the first column of the block ids).
    anchors, w1, w2 = anchors.contiguous(), w1.contiguous(), w2.contiguous()
    num_tiles = triton.cdiv(vocab, BLOCK_V * SUB_TILES)
    # Two partial buffers, alternating: a launch reads the last position's and writes its own.
    parts = [
        (
            torch.empty(num_requests, num_tiles, dtype=torch.float32, device=device),
            torch.empty(num_requests, num_tiles, dtype=torch.int32, device=device),
        )
        for _ in range(2)
    ]
    grid = (num_tiles, triton.cdiv(num_requests, BLOCK_R))
    block_t = next_pow2(num_tiles)
    for k in range(block_size):
        (in_val, in_idx), (out_val, out_idx) = parts[(k + 1) % 2], parts[k % 2]
        _markov_step_kernel[grid](
            base_logits,
            anchors,
            in_val,
            in_idx,
            tokens,
            w1,
            w2,
            out_val,
            out_idx,
            num_requests,
            vocab,
            num_tiles,
            k,
            base_logits.stride(0),
            base_logits.stride(1),
            tokens.stride(0),
            RANK=rank,
            FIRST=k == 0,
            CORR_DTYPE=_TL_DTYPES[w2.dtype],
            DOT_FP32=dot_in_fp32(w2.dtype),
            BLOCK_R=BLOCK_R,
            BLOCK_V=BLOCK_V,
            BLOCK_K=max(16, next_pow2(rank)),
            SUB_TILES=SUB_TILES,
            BLOCK_T=block_t,
        )
    last_val, last_idx = parts[(block_size - 1) % 2]
    _markov_last_kernel[(triton.cdiv(num_requests, BLOCK_R),)](
        last_val,
        last_idx,
        tokens,
        num_requests,
        num_tiles,
        block_size - 1,
        tokens.stride(0),
        BLOCK_R=BLOCK_R,
        BLOCK_T=block_t,
    )
    return tokens
