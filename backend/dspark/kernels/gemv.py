"""Skinny matrix products: y = x W^T for a few rows of x (a decode step of a few requests).

At one to eight rows a projection only streams its weight; cuBLAS's kernels for the Qwen3-8B shape's
smaller projections (o, qkv, down) reached 0.66-0.84 of the copy bandwidth on an H200 (RESULTS.md,
session 14). Each program here owns BLOCK_N output columns, streams their rows of W over the whole
of K in pipelined tiles, and multiplies them against every row of x at once (padded to a power of two,
at least 16 rows, for the tensor cores), so W is read once whatever the row count.

SwiGLU's activation can run in the epilogue of the gate/up projection (`silu_mul_gemv`): each program
multiplies the gate rows and the up rows of its columns and writes silu(gate) * up, one kernel and one
round trip fewer per layer, with the products rounded where the two kernels would round them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark.kernels.common import (
    dependent_launch,
    dot_in_fp32,
    round_cast,
    shared_memory_bytes,
    wait_for_previous,
)

# Rows `gemv` takes at most (a tile of x is padded to the next power of two of them, at least 16);
# which row counts it is used for is `ops.takes_few_rows`'s decision, by measurement.
MAX_ROWS = 64


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


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(n, BLOCK_N),); x [num_rows, k], w [n, k], y [num_rows, n] (unit column strides).

    SILU_MUL: w is [2n, k], gate rows then up rows; y = silu(x w_gate^T) * (x w_up^T), each product
    rounded to y's dtype first, then silu, then the product (as gemv then activation.silu_mul)."""
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before touching memory
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < n
    row_ok = rows < num_rows
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    up_rows = w_ptr + (cols + n).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w_ok = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if SILU_MUL:
            up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
            if FP32_DOT:
                acc_up += tl.dot(x.to(tl.float32), tl.trans(up.to(tl.float32)), input_precision="ieee")
            else:
                acc_up += tl.dot(x, tl.trans(up))
    dtype = y_ptr.dtype.element_ty
    if SILU_MUL:
        gate = round_cast(acc, dtype).to(tl.float32)
        silu = round_cast(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        acc = silu * round_cast(acc_up, dtype).to(tl.float32)
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, round_cast(acc, dtype), mask=row_ok[:, None] & col_ok[None, :])


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    config: GemvConfig,
    out: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    """y [..., n] from x [..., k] and weight [n or 2n, k] (see _gemv_kernel)."""
    k = x.shape[-1]
    if weight.shape[1] != k:
        raise ValueError(f"gemv: x has {k} columns, weight {tuple(weight.shape)}")
    rows = x.reshape(x.numel() // k if k else x.shape[:-1].numel(), k)
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv: {rows.shape[0]} rows, at most {MAX_ROWS}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    y = out.view(rows.shape[0], n)
    if rows.shape[0] and n:
        # tl.dot wants every tile side >= 16; fp32 stays fp32 (no TF32), F.linear's default.
        block_n = max(16, min(config.block_n, triton.next_power_of_2(n)))
        block_k = max(16, min(config.block_k, triton.next_power_of_2(k)))
        # The pipeline keeps num_stages - 1 tiles of x and of each weight in shared memory: fewer stages
        # where a tile tuned for bf16 does not fit (fp32 data, the epilogue's second weight tile).
        block_m = max(16, triton.next_power_of_2(rows.shape[0]))
        tile_bytes = (block_m + block_n * (2 if silu_mul else 1)) * block_k * x.element_size()
        room = shared_memory_bytes(x.device) - (8 << 10)
        # Past one 16-row tile the epilogue's layout buffers grow with the accumulator (on an H100 at 64
        # rows: 48 KiB beside three stages, over the limit with one tile of room): one stage's room kept.
        num_stages = max(1, min(config.num_stages, (0 if block_m > 16 else 1) + room // tile_bytes))
        pdl = dependent_launch(x.device)  # see common.DEPENDENT_LAUNCH
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            rows,
            weight,
            y,
            rows.shape[0],
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            FP32_DOT=dot_in_fp32(x.dtype),
            SILU_MUL=silu_mul,
            PDL=pdl,
            num_stages=num_stages,
            num_warps=config.num_warps,
            launch_pdl=pdl > 0,
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
    n = weight.shape[0]
    return _launch(x, weight, n, config or tile_for(n, x.shape[-1]), out, silu_mul=False)


def silu_mul_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.silu_mul_linear in one kernel: silu(gate) * up of x [..., k] @ weight [2n, k]^T (gate
    rows then up rows) -> [..., n], each product rounded to x's dtype before the activation, as gemv
    then activation.silu_mul do, for at most MAX_ROWS rows of x.

    config: the tile of the whole [2n, k] product (default `tile_for(2n, k)`); each program takes half
    its columns from the gate rows and half from the up rows, so it streams as many bytes."""
    if weight.shape[0] % 2:
        raise ValueError(f"silu_mul_gemv: weight {tuple(weight.shape)} has an odd number of rows")
    n = weight.shape[0] // 2
    config = config or tile_for(2 * n, x.shape[-1])
    half = GemvConfig(max(16, config.block_n // 2), config.block_k, config.num_stages, config.num_warps)
    return _launch(x, weight, n, half, out, silu_mul=True)
