"""The fused SwiGLU activation == its torch reference (elementwise, within two units in the last place),
on ragged row counts, odd widths, strided rows and every dtype; the MLP takes it on a GPU.

On a machine without CUDA the kernel runs in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, width", [(1, 64), (7, 1536), (33, 100), (3, 1)])
def test_silu_mul_matches_reference(num_rows, width, dtype, gen):
    parity.check_silu_mul(KERNELS, num_rows, width, dtype, DEVICE, gen)


def test_silu_mul_reads_strided_rows_wider_than_one_block(gen):
    parity.check_silu_mul(KERNELS, 5, 1500, torch.bfloat16, DEVICE, gen, row_stride=3072)


def test_silu_mul_keeps_leading_dims_and_takes_no_rows(gen):
    gate_up = parity.randn((2, 3, 40), torch.float32, DEVICE, gen)
    got = KERNELS.activation.silu_mul(gate_up)
    assert got.shape == (2, 3, 20)
    torch.testing.assert_close(got, reference.silu_mul(gate_up), **parity.ulp_tolerance(torch.float32))
    assert KERNELS.activation.silu_mul(gate_up[:0]).shape == (0, 3, 20)


def test_ops_sends_cpu_tensors_and_gradients_to_the_reference(gen):
    cpu_gen, _ = parity.generator(
        torch.device("cpu"), int(torch.randint(0, 2**31, (1,), generator=gen, device=DEVICE))
    )
    gate_up = parity.randn((4, 16), torch.float32, torch.device("cpu"), cpu_gen)
    assert torch.equal(ops.silu_mul(gate_up), reference.silu_mul(gate_up))
    trained = parity.randn((4, 16), torch.float32, DEVICE, gen).requires_grad_(True)
    ops.silu_mul(trained).sum().backward()
    assert trained.grad is not None and bool(torch.isfinite(trained.grad).all())


@gpu_only
@pytest.mark.parametrize("num_rows", [1, 64, 2048])
def test_silu_mul_at_smollm2_and_qwen3_8b_widths(num_rows, gen):
    for width in (1536, 12288):
        parity.check_silu_mul(KERNELS, num_rows, width, torch.bfloat16, DEVICE, gen)
