"""Fused RMSNorm, rotary, KV page store, the fused attention prologue and the drafter's KV injection
store == their torch references (elementwise, within two units in the last place; stores exact).

On a machine without CUDA the kernels run in Triton's interpreter (see test_kernels_attention.py).
"""

from __future__ import annotations

import kernel_parity as parity
import pytest
import torch
from kernel_setup import DEVICE, KERNELS, gpu_only

from dspark.kernels import ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_rms_norm_with_and_without_residual(dtype, residual, gen):
    parity.check_rms_norm(KERNELS, 37, 96, dtype, residual, DEVICE, gen)


def test_rms_norm_of_many_short_rows_like_per_head_qk_norm(gen):
    parity.check_rms_norm(KERNELS, 200, 16, torch.bfloat16, False, DEVICE, gen)


def test_rms_norm_keeps_leading_dims_and_strided_input(gen):
    x = parity.randn((3, 5, 64), torch.float32, DEVICE, gen)[:, :, :48]
    weight = parity.randn((48,), torch.float32, DEVICE, gen)
    got, _ = KERNELS.norm.rms_norm(x, weight, 1e-5)
    assert got.shape == (3, 5, 48)
    torch.testing.assert_close(
        got, reference.rms_norm(x, weight, 1e-5)[0], **parity.ulp_tolerance(torch.float32)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype, gen):
    parity.check_rotary(KERNELS, parity.make_rotary_case(11, 6, 2, 16, 4, dtype, DEVICE, gen))


def test_store_kv_writes_exactly_the_given_slots_and_skips_padding(gen):
    parity.check_store_kv(KERNELS, parity.make_rotary_case(13, 4, 4, 16, 4, torch.bfloat16, DEVICE, gen, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rotary_store_kv_fuses_norms_rotation_and_store(dtype, qk_norm, gen):
    case = parity.make_rotary_case(9, 8, 2, 32, 8, dtype, DEVICE, gen, padding_rows=2)
    parity.check_rotary_store_kv(KERNELS, case, qk_norm)


@pytest.mark.parametrize("k_norm", [True, False])
def test_inject_kv_normalizes_rotates_and_stores_context_keys(k_norm, gen):
    case = parity.make_rotary_case(10, 1, 3, 16, 4, torch.bfloat16, DEVICE, gen, padding_rows=1)
    parity.check_inject_kv(KERNELS, case, k_norm)


def test_head_dim_with_a_non_power_of_two_half(gen):
    case = parity.make_rotary_case(5, 3, 1, 24, 4, torch.float32, DEVICE, gen)
    parity.check_rotary_store_kv(KERNELS, case, qk_norm=True)


def test_ops_sends_cpu_tensors_to_the_reference(gen):
    cpu_gen, _ = parity.generator(
        torch.device("cpu"), int(torch.randint(0, 2**31, (1,), generator=gen, device=DEVICE))
    )
    case = parity.make_rotary_case(4, 2, 2, 8, 4, torch.float32, torch.device("cpu"), cpu_gen)
    q = ops.rotary_store_kv(
        case.q, case.k, case.v, case.positions, case.cos_sin, case.k_cache, case.v_cache, case.slots
    )
    ref_caches = (torch.full_like(case.k_cache, float("nan")), torch.full_like(case.v_cache, float("nan")))
    ref_q = reference.rotary_store_kv(
        case.q, case.k, case.v, case.positions, case.cos_sin, *ref_caches, case.slots
    )
    assert torch.equal(q, ref_q)
    torch.testing.assert_close(case.k_cache, ref_caches[0], equal_nan=True, rtol=0, atol=0)


@gpu_only
@pytest.mark.gpu
def test_ops_differentiate_through_the_reference_when_autograd_needs_it(gen):
    # The kernels have no backward: a call that needs gradients must take the reference on CUDA too.
    x = torch.randn(6, 64, device=DEVICE, generator=gen, requires_grad=True)
    weight = torch.rand(64, device=DEVICE, generator=gen) + 0.5
    out, _ = ops.rms_norm(x, weight, 1e-6)
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    reference.rms_norm(x_ref, weight, 1e-6)[0].sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    case = parity.make_rotary_case(4, 2, 2, 16, 4, torch.float32, DEVICE, gen)
    q = case.q.clone().requires_grad_(True)
    q_rot, _ = ops.rotary(q, case.k, case.positions, case.cos_sin)
    assert q_rot.grad_fn is not None
    with torch.no_grad():
        q_fast, _ = ops.rotary(q, case.k, case.positions, case.cos_sin)
    torch.testing.assert_close(q_fast, q_rot.detach())


@gpu_only
@pytest.mark.gpu
def test_realistic_shapes(gen):
    parity.check_rms_norm(KERNELS, 4096, 4096, torch.bfloat16, True, DEVICE, gen)
    case = parity.make_rotary_case(2048, 32, 8, 128, 16, torch.bfloat16, DEVICE, gen, padding_rows=5)
    parity.check_rotary_store_kv(KERNELS, case, qk_norm=True)
    parity.check_inject_kv(KERNELS, case, k_norm=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_steps_rotary_multipliers_made_once_rotate_as_each_layer_would(dtype, cpu_gen):
    """`reference.host_rotation` (a CPU step's rotary multipliers, made once for its layers): the same
    bits as `rotary` working them out itself; one made from other positions or another table is not
    used, whatever its values."""
    num_tokens, head_dim = 7, 32
    table = torch.randn(300, head_dim, generator=cpu_gen)
    positions = torch.randint(0, 300, (num_tokens,), generator=cpu_gen)
    q = torch.randn(num_tokens, 6, head_dim, generator=cpu_gen).to(dtype)
    k = torch.randn(num_tokens, 2, head_dim, generator=cpu_gen).to(dtype)
    expected = reference.rotary(q, k, positions, table)
    made = reference.host_rotation(positions, table)
    for got in (
        reference.rotary(q, k, positions, table, made),
        reference.rotary(q, k, positions, table, reference.host_rotation(positions.flip(0), table)),
        reference.rotary(q, k, positions, table, reference.host_rotation(positions, table * 2)),
    ):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    wrong = reference.rotary(q, k, positions, table * 2)
    assert not torch.equal(wrong[0], expected[0])


def test_a_host_layout_carries_the_rotary_multipliers_of_its_own_positions():
    """AttentionBatch.build on the CPU with the model's rotary table: multipliers of the layout's own
    positions (none for a padded layout, or without a table)."""
    from dspark.runner.attention_batch import AttentionBatch

    cpu = torch.device("cpu")
    table = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    batch = AttentionBatch.build([[3, 4], [9]], [10, 2], [4, 1], 8, True, cpu, rotary_table=table)
    rotation = batch.host_rotation
    assert rotation is not None and rotation.positions is batch.positions and rotation.table is table
    assert batch.positions.tolist() == [10, 11, 12, 13, 2]
    torch.testing.assert_close(rotation.cos[:, 0, :4], table[batch.positions, :4], rtol=0, atol=0)
    assert (
        AttentionBatch.build(
            [[3, 4]], [10], [4], 8, True, cpu, num_tokens=6, rotary_table=table
        ).host_rotation
        is None
    )
    assert AttentionBatch.build([[3, 4]], [10], [4], 8, True, cpu).host_rotation is None
