"""The skinny-product kernel == F.linear (the torch reference: x W^T accumulated in fp32, rounded once)
on random inputs drawn fresh each run: 1 to 64 rows, ragged widths that no tile divides, strided rows
and weights, every dtype, and the Qwen3-8B and SmolLM2 projection shapes on a GPU; the model's
projections take it for a few rows on a GPU and only then.

On a machine without CUDA the kernel runs in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import math

import kernel_parity as parity
import pytest
import torch
import torch.nn.functional as F
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(x: torch.Tensor, weight: torch.Tensor, config=None) -> None:
    out = parity.poisoned((*x.shape[:-1], weight.shape[0]), x.dtype, x.device)
    got = KERNELS.gemv.gemv(x, weight, config, out=out)
    assert got is out
    ref = F.linear(x.float(), weight.float()).to(x.dtype)
    assert got.shape == ref.shape and got.dtype == x.dtype
    if not ref.numel():
        return
    tolerance = parity.ulp_tolerance(x.dtype)
    # Sums of k products of unit normals are ~sqrt(k) large; summed in another order they differ by
    # about that many fp32 units (fp32), or round to a neighbour (half types).
    scale = math.sqrt(max(x.shape[-1], 1))
    torch.testing.assert_close(got, ref, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, n, k",
    [
        (1, 64, 64),
        (3, 100, 300),
        (8, 33, 17),
        (16, 5, 1000),
        (2, 1, 1),
        (17, 40, 70),
        (33, 24, 129),
        (64, 9, 200),
    ],
)
def test_gemv_matches_f_linear(rows, n, k, dtype, gen):
    x = parity.randn((rows, k), dtype, DEVICE, gen)
    weight = parity.randn((n, k), dtype, DEVICE, gen)
    check(x, weight)


@pytest.mark.parametrize(
    "config",
    [
        dict(block_n=16, block_k=16, num_stages=2, num_warps=4),
        dict(block_n=64, block_k=128, num_stages=3, num_warps=8),
    ],
)
def test_every_tile_covers_ragged_widths(config, gen):
    x = parity.randn((5, 231), torch.float32, DEVICE, gen)
    weight = parity.randn((77, 231), torch.float32, DEVICE, gen)
    check(x, weight, KERNELS.gemv.GemvConfig(**config))


def test_strided_rows_and_weight_and_leading_dims(gen):
    wide = parity.randn((2, 3, 300), torch.bfloat16, DEVICE, gen)
    x = wide[..., :200]  # rows with a stride wider than their width
    weight = parity.randn((40, 400), torch.bfloat16, DEVICE, gen)[:, ::2]  # a column stride of 2
    got = KERNELS.gemv.gemv(x, weight)
    assert got.shape == (2, 3, 40)
    check(x, weight)


def test_no_rows_no_columns_and_an_empty_reduction(gen):
    assert KERNELS.gemv.gemv(torch.empty((0, 8), device=DEVICE), torch.ones((4, 8), device=DEVICE)).shape == (
        0,
        4,
    )
    assert KERNELS.gemv.gemv(torch.ones((2, 8), device=DEVICE), torch.empty((0, 8), device=DEVICE)).shape == (
        2,
        0,
    )
    empty = KERNELS.gemv.gemv(torch.ones((2, 0), device=DEVICE), torch.empty((3, 0), device=DEVICE))
    assert torch.equal(empty, torch.zeros((2, 3), device=DEVICE))


def test_too_many_rows_or_a_wrong_width_is_refused(gen):
    with pytest.raises(ValueError, match="rows"):
        KERNELS.gemv.gemv(torch.ones((65, 8), device=DEVICE), torch.ones((4, 8), device=DEVICE))
    with pytest.raises(ValueError, match="columns"):
        KERNELS.gemv.gemv(torch.ones((2, 8), device=DEVICE), torch.ones((4, 9), device=DEVICE))


@gpu_only
@pytest.mark.parametrize("rows", [1, 4, 8, 16, 32, 64])
@pytest.mark.parametrize(
    "n, k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (960, 576), (576, 1536)]
)
def test_projection_shapes_of_qwen3_8b_and_smollm2(rows, n, k, gen):
    x = parity.randn((rows, k), torch.bfloat16, DEVICE, gen)
    weight = parity.randn((n, k), torch.bfloat16, DEVICE, gen) / math.sqrt(k)
    check(x, weight)


def test_ops_sends_cpu_tensors_and_gradients_to_the_reference(gen):
    # Drawn where `gen` lives (the GPU's generator on a GPU), then moved to the CPU.
    x = parity.randn((3, 40), torch.float32, DEVICE, gen).cpu()
    weight = parity.randn((24, 40), torch.float32, DEVICE, gen).cpu()
    assert torch.equal(ops.few_rows_linear(x, weight), reference.few_rows_linear(x, weight))
    # Half precision on the kernel's device: only the gradient sends it to the reference.
    trained = weight.to(DEVICE, torch.bfloat16).requires_grad_(True)
    ops.few_rows_linear(x.to(DEVICE, torch.bfloat16), trained).float().sum().backward()
    assert trained.grad is not None
    expected = x.to(torch.bfloat16).float().sum(0).expand_as(weight)
    torch.testing.assert_close(trained.grad.float().cpu(), expected, rtol=1.6e-2, atol=1.6e-2)


@gpu_only
def test_a_gpu_projection_takes_the_kernel_for_a_few_rows_only(gen):
    """layers.linear on a GPU: the kernel's result for 1..FEW_ROWS rows of half precision within the
    widest measured weight (up to SMALL_WEIGHT_ROWS rows of a small weight), cuBLAS's (F.linear)
    otherwise: more rows, a bias, fp32, an LM head."""
    from dspark.runner.models.layers import linear

    weight = parity.randn((96, 64), torch.bfloat16, DEVICE, gen)
    for rows in (1, ops.FEW_ROWS, ops.FEW_ROWS + 1, ops.SMALL_WEIGHT_ROWS):
        x = parity.randn((rows, 64), torch.bfloat16, DEVICE, gen)
        assert torch.equal(linear(x, weight), KERNELS.gemv.gemv(x, weight)), rows
    more = parity.randn((ops.SMALL_WEIGHT_ROWS + 1, 64), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(more, weight), F.linear(more, weight))
    # One element past a small weight: the kernel for FEW_ROWS rows, cuBLAS past them.
    inputs = ops.SMALL_WEIGHT_MAX_ELEMENTS // 1024 + 1
    large = parity.randn((1024, inputs), torch.bfloat16, DEVICE, gen)
    x = parity.randn((ops.FEW_ROWS, inputs), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(x, large), KERNELS.gemv.gemv(x, large))
    x = parity.randn((ops.FEW_ROWS + 1, inputs), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(x, large), F.linear(x, large))
    x = parity.randn((2, 64), torch.bfloat16, DEVICE, gen)
    bias = parity.randn((96,), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    assert torch.equal(linear(x.float(), weight.float()), F.linear(x.float(), weight.float()))
    head = parity.randn((ops.FEW_ROWS_MAX_OUTPUTS + 1, 64), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(x, head), F.linear(x, head))


@pytest.mark.parametrize("n, k", [(100, 2000), (2000, 300), (5000, 64), (9000, 40)])
def test_the_tile_of_every_band_of_widths(n, k, gen):
    """`tile_for` picks by bands of n and k; each band's tile covers its ragged shapes."""
    x = parity.randn((3, k), torch.bfloat16, DEVICE, gen)
    weight = parity.randn((n, k), torch.bfloat16, DEVICE, gen)
    check(x, weight)


# SwiGLU's activation in the gate/up product's epilogue ------------------------------------------------


def check_silu_mul(x: torch.Tensor, weight: torch.Tensor, config=None) -> torch.Tensor:
    """silu_mul_gemv against the reference (the product in fp32, rounded, then the activation)."""
    n = weight.shape[0] // 2
    out = parity.poisoned((*x.shape[:-1], n), x.dtype, x.device)
    got = KERNELS.gemv.silu_mul_gemv(x, weight, config, out=out)
    assert got is out and got.shape == (*x.shape[:-1], n)
    ref = reference.silu_mul(F.linear(x.float(), weight.float()).to(x.dtype))
    if ref.numel():
        tolerance = parity.ulp_tolerance(x.dtype)
        scale = math.sqrt(max(x.shape[-1], 1))
        torch.testing.assert_close(got, ref, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, n, k",
    [(1, 32, 64), (3, 50, 300), (8, 17, 33), (16, 5, 1000), (2, 1, 1), (24, 20, 90), (64, 6, 150)],
)
def test_the_activation_in_the_product_matches_the_product_then_the_activation(rows, n, k, dtype, gen):
    x = parity.randn((rows, k), dtype, DEVICE, gen)
    weight = parity.randn((2 * n, k), dtype, DEVICE, gen) / math.sqrt(k) * 3
    check_silu_mul(x, weight)


def test_the_activation_in_the_product_on_strided_rows_a_small_tile_and_no_rows(gen):
    wide = parity.randn((2, 3, 300), torch.bfloat16, DEVICE, gen)
    x = wide[..., :200]
    weight = parity.randn((2 * 40, 400), torch.bfloat16, DEVICE, gen)[:, ::2] / 5
    assert check_silu_mul(x, weight).shape == (2, 3, 40)
    check_silu_mul(x, weight, KERNELS.gemv.GemvConfig(block_n=16, block_k=16, num_stages=2))
    empty = KERNELS.gemv.silu_mul_gemv(torch.empty((0, 8), device=DEVICE), torch.ones((6, 8), device=DEVICE))
    assert empty.shape == (0, 3)
    with pytest.raises(ValueError, match="odd"):
        KERNELS.gemv.silu_mul_gemv(torch.ones((2, 8), device=DEVICE), torch.ones((5, 8), device=DEVICE))


def test_ops_leaves_the_activation_apart_on_a_cpu_and_for_gradients(gen):
    x = parity.randn((3, 40), torch.float32, DEVICE, gen).cpu()
    weight = parity.randn((48, 40), torch.float32, DEVICE, gen).cpu()
    assert torch.equal(ops.silu_mul_linear(x, weight), reference.silu_mul(F.linear(x, weight)))
    trained = weight.to(DEVICE, torch.bfloat16).requires_grad_(True)
    ops.silu_mul_linear(x.to(DEVICE, torch.bfloat16), trained).float().sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


@gpu_only
@pytest.mark.parametrize("rows", [1, 4, 8, 32])
@pytest.mark.parametrize("n, k", [(12288, 4096), (1536, 576)])
def test_the_activation_in_the_product_at_the_gate_up_shapes_is_the_two_kernels_to_the_bit(rows, n, k, gen):
    """At the Qwen3-8B and SmolLM2 gate/up shapes the epilogue rounds where gemv then silu_mul round:
    the same bits (so a step's result does not depend on which path its row count takes)."""
    x = parity.randn((rows, k), torch.bfloat16, DEVICE, gen)
    weight = parity.randn((2 * n, k), torch.bfloat16, DEVICE, gen) / math.sqrt(k) * 3
    got = check_silu_mul(x, weight)
    assert torch.equal(got, KERNELS.activation.silu_mul(KERNELS.gemv.gemv(x, weight)))


@gpu_only
def test_a_gpu_gate_up_projection_takes_the_epilogue_for_a_few_rows_only(gen):
    from dspark.runner.models.layers import ColumnParallelLinear

    proj = ColumnParallelLinear(64, [48, 48], bias=False, shard_names=["gate", "up"]).to(
        DEVICE, torch.bfloat16
    )
    proj.weight.data = parity.randn((96, 64), torch.bfloat16, DEVICE, gen) / 4
    for rows in (1, ops.FEW_ROWS, ops.SMALL_WEIGHT_ROWS):
        x = parity.randn((rows, 64), torch.bfloat16, DEVICE, gen)
        assert torch.equal(proj.forward_silu_mul(x), KERNELS.gemv.silu_mul_gemv(x, proj.weight))
    more = parity.randn((ops.SMALL_WEIGHT_ROWS + 1, 64), torch.bfloat16, DEVICE, gen)
    assert torch.equal(proj.forward_silu_mul(more), ops.silu_mul(F.linear(more, proj.weight)))
