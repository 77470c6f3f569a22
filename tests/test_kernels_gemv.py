"""The skinny-product kernel == F.linear (the torch reference: x W^T accumulated in fp32, rounded once)
on random inputs drawn fresh each run: 1 to 16 rows, ragged widths that no tile divides, strided rows
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
@pytest.mark.parametrize("rows, n, k", [(1, 64, 64), (3, 100, 300), (8, 33, 17), (16, 5, 1000), (2, 1, 1)])
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
        KERNELS.gemv.gemv(torch.ones((17, 8), device=DEVICE), torch.ones((4, 8), device=DEVICE))
    with pytest.raises(ValueError, match="columns"):
        KERNELS.gemv.gemv(torch.ones((2, 8), device=DEVICE), torch.ones((4, 9), device=DEVICE))


@gpu_only
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize(
    "n, k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (960, 576), (576, 1536)]
)
def test_projection_shapes_of_qwen3_8b_and_smollm2(rows, n, k, gen):
    x = parity.randn((rows, k), torch.bfloat16, DEVICE, gen)
    weight = parity.randn((n, k), torch.bfloat16, DEVICE, gen) / math.sqrt(k)
    check(x, weight)


def test_ops_sends_cpu_tensors_and_gradients_to_the_reference(gen):
    x = parity.randn((3, 40), torch.float32, torch.device("cpu"), gen)
    weight = parity.randn((24, 40), torch.float32, torch.device("cpu"), gen)
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
    widest measured weight, cuBLAS's (F.linear) otherwise: more rows, a bias, fp32, an LM head."""
    from dspark.runner.models.layers import linear

    weight = parity.randn((96, 64), torch.bfloat16, DEVICE, gen)
    for rows in (1, ops.FEW_ROWS):
        x = parity.randn((rows, 64), torch.bfloat16, DEVICE, gen)
        assert torch.equal(linear(x, weight), KERNELS.gemv.gemv(x, weight))
    more = parity.randn((ops.FEW_ROWS + 1, 64), torch.bfloat16, DEVICE, gen)
    assert torch.equal(linear(more, weight), F.linear(more, weight))
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


# The prologues: the norm before a projection, SwiGLU's activation before the down projection --------


def check_rms_norm_gemv(x, residual, norm_weight, weight, config=None) -> None:
    """rms_norm_gemv == the reference's norm then the product: the residual sum exactly, the product
    to the dtype's rounding (it rounds the rows once, the reference twice)."""
    y, summed = KERNELS.gemv.rms_norm_gemv(x, norm_weight, 1e-6, residual, weight, config)
    ref_y, ref_summed = reference.rms_norm_linear(x, norm_weight, 1e-6, residual, weight)
    assert y.shape == ref_y.shape and y.dtype == x.dtype and summed.shape == x.shape
    if residual is None:
        assert summed is x
    else:
        assert torch.equal(summed, ref_summed)
    if not ref_y.numel():
        return
    # The reference's own product in fp32 from its rounded rows, to compare in one precision.
    normed, _ = reference.rms_norm(x, norm_weight, 1e-6, residual)
    exact = F.linear(normed.float(), weight.float())
    assert not torch.isnan(y).any()
    bound = 2e-5 if x.dtype == torch.float32 else 1.2e-2
    assert parity.rel_err(y, exact) <= bound, parity.rel_err(y, exact)
    assert parity.rel_err(ref_y, exact) <= bound  # the reference itself, as a sanity bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows, n, k", [(1, 64, 64), (3, 100, 300), (8, 33, 17), (16, 5, 1000)])
def test_the_norm_in_the_product_matches_the_norm_then_the_product(rows, n, k, with_residual, dtype, gen):
    x = parity.randn((rows, k), dtype, DEVICE, gen) * 3
    residual = parity.randn((rows, k), dtype, DEVICE, gen) * 3 if with_residual else None
    norm_weight = (1 + 0.2 * parity.randn((k,), torch.float32, DEVICE, gen)).to(dtype)
    weight = parity.randn((n, k), dtype, DEVICE, gen) / math.sqrt(k)
    check_rms_norm_gemv(x, residual, norm_weight, weight)


def test_the_norm_in_the_product_on_strided_rows_and_a_small_tile(gen):
    wide = parity.randn((2, 3, 300), torch.bfloat16, DEVICE, gen)
    x = wide[..., :200]  # rows with a stride wider than their width, and leading dimensions
    residual = parity.randn((2, 3, 200), torch.bfloat16, DEVICE, gen)
    norm_weight = parity.randn((200,), torch.bfloat16, DEVICE, gen)
    weight = parity.randn((40, 200), torch.bfloat16, DEVICE, gen)
    y, summed = KERNELS.gemv.rms_norm_gemv(x, norm_weight, 1e-6, residual, weight)
    assert y.shape == (2, 3, 40) and summed.shape == (2, 3, 200)
    tile = KERNELS.gemv.GemvConfig(block_n=16, block_k=16, num_stages=2)
    check_rms_norm_gemv(x, residual, norm_weight, weight, tile)


def test_the_norm_in_the_product_refuses_a_mismatched_residual_or_norm(gen):
    x = torch.ones((2, 8), device=DEVICE)
    weight = torch.ones((4, 8), device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        KERNELS.gemv.rms_norm_gemv(
            x, torch.ones(8, device=DEVICE), 1e-6, torch.ones((2, 7), device=DEVICE), weight
        )
    with pytest.raises(ValueError, match="norm weight"):
        KERNELS.gemv.rms_norm_gemv(x, torch.ones(7, device=DEVICE), 1e-6, None, weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n, k", [(1, 64, 64), (5, 77, 231), (16, 9, 40)])
def test_the_activation_in_the_product_is_the_two_kernels_it_replaces(rows, n, k, dtype, gen):
    """silu_mul_gemv rounds where activation.silu_mul then gemv round, so with the same tile the
    result is the same to the bit; and both agree with the reference to the dtype's rounding."""
    wide = parity.randn((rows, 2 * k + 6), dtype, DEVICE, gen) * 3
    gate_up = wide[:, : 2 * k]  # strided rows
    weight = parity.randn((n, k), dtype, DEVICE, gen) / math.sqrt(k)
    out = parity.poisoned((rows, n), dtype, DEVICE)
    got = KERNELS.gemv.silu_mul_gemv(gate_up, weight, out=out)
    assert got is out
    two_kernels = KERNELS.gemv.gemv(KERNELS.activation.silu_mul(gate_up), weight)
    assert torch.equal(got, two_kernels)
    ref = reference.silu_mul_linear(gate_up, weight)
    exact = F.linear(reference.silu_mul(gate_up).float(), weight.float())
    bound = 2e-5 if dtype == torch.float32 else 1.2e-2
    assert parity.rel_err(got, exact) <= bound and parity.rel_err(ref, exact) <= bound


def test_the_activation_in_the_product_refuses_an_odd_width():
    with pytest.raises(ValueError, match="odd"):
        KERNELS.gemv.silu_mul_gemv(torch.ones((2, 9), device=DEVICE), torch.ones((4, 4), device=DEVICE))


def test_the_fused_ops_leave_cpu_tensors_and_gradients_to_the_two_ops(gen):
    cpu = torch.device("cpu")
    x = parity.randn((3, 40), torch.float32, cpu, gen)
    residual = parity.randn((3, 40), torch.float32, cpu, gen)
    norm_weight = parity.randn((40,), torch.float32, cpu, gen)
    weight = parity.randn((24, 40), torch.float32, cpu, gen)
    assert not ops.fuses_norm(x, norm_weight, residual, weight)
    y, summed = ops.rms_norm_linear(x, norm_weight, 1e-6, residual, weight)
    ref_y, ref_summed = reference.rms_norm_linear(x, norm_weight, 1e-6, residual, weight)
    assert torch.equal(y, ref_y) and torch.equal(summed, ref_summed)
    gate_up = parity.randn((3, 48), torch.float32, cpu, gen)
    assert not ops.fuses_activation(gate_up, weight[:, :24])
    assert torch.equal(
        ops.silu_mul_linear(gate_up, weight[:, :24]), reference.silu_mul_linear(gate_up, weight[:, :24])
    )
    # On the kernel's device a norm weight that wants a gradient (drafter training) keeps the two ops.
    half = x.to(DEVICE, torch.bfloat16)
    trained = norm_weight.to(DEVICE, torch.bfloat16).requires_grad_(True)
    assert not ops.fuses_norm(half, trained, None, weight.to(DEVICE, torch.bfloat16))
    y, _ = ops.rms_norm_linear(half, trained, 1e-6, None, weight.to(DEVICE, torch.bfloat16))
    y.float().sum().backward()
    assert trained.grad is not None


@gpu_only
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("n, k", [(6144, 4096), (24576, 4096), (960, 576), (3072, 576)])
def test_the_norm_in_the_product_at_the_projection_shapes(rows, n, k, gen):
    x = parity.randn((rows, k), torch.bfloat16, DEVICE, gen) * 8
    residual = parity.randn((rows, k), torch.bfloat16, DEVICE, gen) * 8
    norm_weight = (1 + 0.2 * parity.randn((k,), torch.float32, DEVICE, gen)).to(torch.bfloat16)
    weight = parity.randn((n, k), torch.bfloat16, DEVICE, gen) / math.sqrt(k)
    check_rms_norm_gemv(x, residual, norm_weight, weight)


@gpu_only
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("n, k", [(4096, 12288), (576, 1536)])
def test_the_activation_in_the_product_at_the_down_shapes(rows, n, k, gen):
    gate_up = parity.randn((rows, 2 * k), torch.bfloat16, DEVICE, gen) * 3
    weight = parity.randn((n, k), torch.bfloat16, DEVICE, gen) / math.sqrt(k)
    got = KERNELS.gemv.silu_mul_gemv(gate_up, weight)
    assert torch.equal(got, KERNELS.gemv.gemv(KERNELS.activation.silu_mul(gate_up), weight))


@gpu_only
def test_a_gpu_decoder_layer_fuses_exactly_where_the_kernel_takes_the_product(gen):
    """A bf16 decoder layer on a GPU: the norms and the activation run inside the products at a few
    rows (fewer kernels, the same values to bf16 rounding), and as separate kernels past FEW_ROWS."""
    from dspark.runner.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear

    norm = RMSNorm(64, 1e-6).to(DEVICE, torch.bfloat16)
    norm.weight.data = (1 + 0.2 * parity.randn((64,), torch.float32, DEVICE, gen)).to(torch.bfloat16)
    proj = ColumnParallelLinear(64, [96], bias=False).to(DEVICE, torch.bfloat16)
    proj.weight.data = parity.randn((96, 64), torch.bfloat16, DEVICE, gen) / 8
    down = RowParallelLinear(48, 64, bias=False).to(DEVICE, torch.bfloat16)
    down.weight.data = parity.randn((64, 48), torch.bfloat16, DEVICE, gen) / 7
    for rows in (1, ops.FEW_ROWS, ops.FEW_ROWS + 1):
        x = parity.randn((rows, 64), torch.bfloat16, DEVICE, gen)
        residual = parity.randn((rows, 64), torch.bfloat16, DEVICE, gen)
        y, summed = proj.forward_normed(norm, x, residual)
        normed, ref_summed = norm(x, residual)
        assert torch.equal(summed, ref_summed)
        two_ops = proj(normed)
        if rows <= ops.FEW_ROWS:
            assert torch.equal(y, KERNELS.gemv.rms_norm_gemv(x, norm.weight, 1e-6, residual, proj.weight)[0])
            assert parity.rel_err(y, two_ops) <= 1.2e-2
        else:
            assert torch.equal(y, two_ops)
        gate_up = parity.randn((rows, 96), torch.bfloat16, DEVICE, gen)
        assert torch.equal(down.forward_silu_mul(gate_up), down(ops.silu_mul(gate_up)))
