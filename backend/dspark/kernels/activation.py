"""Fused SwiGLU activation: silu(gate) * up in one pass over the gate/up projection's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dependent_launch, round_cast, wait_for_previous


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    num_rows,
    width,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, cdiv(width, BLOCK)); gate_up [rows, 2 * width] (gate then up, row stride given);
    out [rows, width].

    Rounds where the reference does: silu(gate) to the input dtype, then the product to out's dtype."""
    wait_for_previous(PDL)  # launched dependent on the kernel before: wait for it before touching memory
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    base = gate_up_ptr + row * stride_in
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_cast(gate / (1.0 + tl.exp(-gate)), gate_up_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_cast(silu * up, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2 * width] (the reference's silu_mul): [..., width].

    out optionally supplies the result (same leading shape, unit column stride)."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    out2 = out.view(-1, width)
    num_rows = rows.shape[0]
    if num_rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 1024)
    pdl = dependent_launch(gate_up.device)  # see common.DEPENDENT_LAUNCH
    _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](
        rows,
        out2,
        num_rows,
        width,
        rows.stride(0),
        out2.stride(0),
        BLOCK=block,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl > 0,
    )
    return out
