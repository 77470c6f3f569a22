"""Fused RMSNorm with the residual add: one pass reads x (+ residual), writes the sum and the norm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dependent_launch, next_pow2, round_cast, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(rows, ROWS),); x, residual, out, res_out [rows, hidden] (row strides given); w [hidden].

    Rounds where the reference does: the sum to the residual dtype, the normalized x to x's dtype,
    then the product with w to out's dtype."""
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before touching memory
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols[None, :] < hidden)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        summed = round_cast(x + r.to(tl.float32), res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows64[:, None] * stride_ro + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)
        normed = round_cast(x * inv[:, None], res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        inv = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)
        normed = round_cast(x * inv[:, None], x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + rows64[:, None] * stride_o + cols[None, :],
        round_cast(normed * w[None, :], out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [rows, hidden] with unit column stride (a view when possible)."""
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm with optional fused residual add (the reference's rms_norm).

    x, residual: [..., hidden]; weight: [hidden]. Returns (norm(x + residual) * weight, x + residual),
    or (norm(x) * weight, None) without a residual; out optionally supplies both result tensors.
    """
    hidden = x.shape[-1]
    shape = x.shape
    x2 = _rows(x, hidden)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(sum_dtype, weight.dtype)
    if out is None:
        normed = torch.empty(shape, dtype=out_dtype, device=x.device)
        summed = None if residual is None else torch.empty(shape, dtype=sum_dtype, device=x.device)
    else:
        normed, summed = out
    out2 = normed.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual, hidden)
        s2 = summed.view(-1, hidden)
    else:
        r2 = s2 = x2
    num_rows = x2.shape[0]
    if num_rows == 0:
        return normed, summed
    block_h = next_pow2(hidden)
    # Small rows (q/k norms over head_dim) share a program so each moves a useful amount of data.
    rows_per_program = max(1, min(16, 2048 // block_h))
    num_warps = 4 if block_h <= 1024 else (8 if block_h <= 4096 else 16)
    pdl = dependent_launch(x.device)  # see common.DEPENDENT_LAUNCH
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x2,
        r2,
        weight,
        out2,
        s2,
        num_rows,
        hidden,
        eps,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        s2.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        ROWS=rows_per_program,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl > 0,
    )
    return normed, summed
