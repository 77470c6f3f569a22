"""Skinny matrix products: y = x W^T for a few rows of x (a decode step of up to 8 requests).

At one to eight rows a projection only streams its weight; cuBLAS's kernels for the Qwen3-8B shape's
smaller projections (o, qkv, down) reached 0.66-0.84 of the copy bandwidth on an H200 (RESULTS.md,
session 14). Each program here owns BLOCK_N output columns, streams their rows of W over the whole
of K in pipelined tiles, and multiplies them against every row of x at once (padded to 16 rows for
the tensor cores), so W is read once whatever the row count.

The rows can be computed on the way in (a prologue), which removes a kernel and a round trip of its
output for each: the RMSNorm (with its residual add) before the qkv and gate/up projections, and
SwiGLU's activation before the down projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dot_in_fp32, round_cast

# Rows up to which `gemv` is meant to be used; more rows are a GEMM's job.
MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one program: output columns, reduction chunk, pipeline depth, warps."""

    block_n: int = 32
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4


def tile_for(n: int, k: int) -> GemvConfig:
    """The tile for a weight [n, k]: the fastest of a 48-tile sweep for each projection of the SmolLM2
    and Qwen3-8B shapes on an H200 (`benchmarks/gemv.py`), by bands of n (programs per multiprocessor)
    and k (bytes each program streams)."""
    if n <= 1024:
        return GemvConfig(block_n=16, block_k=512 if k > 1024 else 256, num_stages=6 if k <= 1024 else 3)
    if n <= 4096:
        return GemvConfig(block_n=32, block_k=512 if k >= 4096 else 128, num_stages=4)
    if n <= 8192:
        return GemvConfig(block_n=64, block_k=256, num_stages=4)
    return GemvConfig(block_n=64, block_k=128, num_stages=3)


# What a program computes from the rows it reads before multiplying them (`_gemv_kernel`'s PROLOGUE).
NO_PROLOGUE, RMS_NORM, SILU_MUL = 0, 1, 2


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    sum_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    n,
    k,
    eps,
    stride_x,
    stride_res,
    stride_sum,
    stride_w,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid (cdiv(n, BLOCK_N),); w [n, k], y [num_rows, n] (unit column strides). The rows multiplied:

    - NO_PROLOGUE: x [num_rows, k];
    - RMS_NORM: RMSNorm(x (+ res)) * norm_w of x, res [num_rows, k]; each program sums the squares of
      the rows it streams anyway and scales its dot products by their reciprocal root at the end (the
      scale is per row, so it factors out of the sum). With a residual, program 0 also writes x + res
      to sum [num_rows, k];
    - SILU_MUL: silu(gate) * up of x [num_rows, 2k] (gate then up), rounded as activation.py does.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)[:, None]
    col_ok = cols < n
    row_ok = rows < num_rows
    dtype = y_ptr.dtype.element_ty
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows64 * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # Program 0 writes the residual sum: every row for it, none for the others.
    sum_row_ok = rows < tl.where(tl.program_id(0) == 0, num_rows, 0)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x_ok = row_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if PROLOGUE == 1:
            xf = tl.load(x_rows + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows64 * stride_res + ks[None, :], mask=x_ok, other=0.0)
                summed = round_cast(xf + r.to(tl.float32), dtype)
                tl.store(
                    sum_ptr + rows64 * stride_sum + ks[None, :],
                    summed,
                    mask=sum_row_ok[:, None] & k_ok[None, :],
                )
                xf = summed.to(tl.float32)
            squares += tl.sum(xf * xf, 1)
            g = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = round_cast(xf * g[None, :], dtype)
        elif PROLOGUE == 2:
            gate = tl.load(x_rows + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
            silu = round_cast(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
            x = round_cast(silu * up, dtype)
        else:
            x = tl.load(x_rows + ks[None, :], mask=x_ok, other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(squares / k + eps)[:, None]
    out = y_ptr + rows64 * stride_y + cols[None, :]
    tl.store(out, round_cast(acc, dtype), mask=row_ok[:, None] & col_ok[None, :])


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with unit column stride (a view when possible), at most MAX_ROWS rows."""
    rows = t.reshape(t.numel() // width if width else t.shape[:-1].numel(), width)
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv: {rows.shape[0]} rows, at most {MAX_ROWS}")
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    config: GemvConfig | None,
    out: torch.Tensor | None,
    prologue: int = NO_PROLOGUE,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    summed: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """y [..., n] = (rows of x after `prologue`) @ weight [n, k]^T; x [..., k] or [..., 2k] (SILU_MUL)."""
    n = weight.shape[0]
    config = config or tile_for(n, k)
    if weight.shape[1] != k:
        raise ValueError(f"gemv: the rows have {k} columns, weight {tuple(weight.shape)}")
    rows = _rows(x, x.shape[-1])
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    y = out.view(rows.shape[0], n)
    res = _rows(residual, k) if residual is not None else rows
    sums = summed.view(rows.shape[0], k) if summed is not None else rows
    if rows.shape[0] and n:
        # tl.dot wants every tile side >= 16; fp32 stays fp32 (no TF32), F.linear's default.
        block_n = max(16, min(config.block_n, triton.next_power_of_2(n)))
        block_k = max(16, min(config.block_k, triton.next_power_of_2(k)))
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            rows,
            res,
            norm_weight if norm_weight is not None else weight,
            sums,
            weight,
            y,
            rows.shape[0],
            n,
            k,
            eps,
            rows.stride(0),
            res.stride(0),
            sums.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=16,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            FP32_DOT=dot_in_fp32(x.dtype),
            PROLOGUE=prologue,
            HAS_RESIDUAL=residual is not None,
            num_stages=config.num_stages,
            num_warps=config.num_warps,
        )
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., k] @ weight [n, k]^T -> [..., n] in x's dtype, accumulated in fp32 (F.linear's contract
    without a bias), for at most MAX_ROWS rows of x.

    config: the tile (a tuning override; default `tile_for`); out optionally supplies the result ([..., n],
    contiguous)."""
    return _launch(x, weight, x.shape[-1], config, out)


def rms_norm_gemv(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm_linear in one kernel: (RMSNorm(x + residual) * norm_weight @ weight^T,
    x + residual), or x itself as the second without a residual. x, residual [..., k] of one dtype.

    The norm's scale is applied to the dot products rather than to the rows, so the rows are rounded
    once (x * norm_weight) where the reference rounds twice; results agree to the dtype's rounding."""
    k = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm_gemv: residual {tuple(residual.shape)} {residual.dtype} is not x's")
    if norm_weight.shape != (k,):
        raise ValueError(f"rms_norm_gemv: norm weight {tuple(norm_weight.shape)} for {k} columns")
    summed = torch.empty_like(x) if residual is not None else None
    y = _launch(x, weight, k, config, None, RMS_NORM, residual, norm_weight.contiguous(), summed, eps)
    return y, (x if summed is None else summed)


def silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.silu_mul_linear in one kernel: silu(gate) * up of gate_up [..., 2k] @ weight [n, k]^T,
    rounded where the two kernels it replaces round (the same result as activation.silu_mul then gemv
    with the same tile)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_gemv: gate_up has an odd width {gate_up.shape[-1]}")
    return _launch(gate_up, weight, gate_up.shape[-1] // 2, config, out, SILU_MUL)
