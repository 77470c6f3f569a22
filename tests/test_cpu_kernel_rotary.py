"""The CPU extension's attention prologue (`kernels/cpu/rotary.cpp`, `ops.rotary_store_kv` on fp32 CPU
tensors): the reference's bits on fresh random inputs of ragged shapes (q, k, v as views of one qkv
product, padding slots, one token to a prefill chunk's many, q/k norms first), and the calls it leaves
to the reference."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels import ops, reference
from dspark.kernels.cpu import linear as cpu_kernels

REASON = cpu_kernels.why_not()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"no CPU kernel here: {REASON}")


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs each run."""
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _case(gen: torch.Generator, tokens: int, num_q: int, num_kv: int, d: int, pad: bool):
    """q, k, v (views of one [tokens, (num_q + 2 num_kv) d] product), positions, a cos/sin table,
    empty caches of 8 pages x 16 slots, and distinct slots (some negative when `pad`)."""
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * d, generator=gen)
    q, k, v = qkv.split([num_q * d, num_kv * d, num_kv * d], dim=-1)
    q, k, v = q.reshape(tokens, num_q, d), k.reshape(tokens, num_kv, d), v.reshape(tokens, num_kv, d)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    table = torch.randn(300, d, generator=gen)
    caches = torch.zeros(2, 8, 16, num_kv, d)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    if pad:
        slots[torch.rand(tokens, generator=gen) < 0.3] = -1
    return q, k, v, positions, table, caches, slots


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 3, 4, 33, 100])
@pytest.mark.parametrize(("num_q", "num_kv", "d"), [(9, 3, 64), (4, 4, 8), (2, 1, 6), (3, 1, 128)])
@pytest.mark.parametrize("pad", [False, True])
def test_the_cpu_prologue_gives_the_reference_bits(
    tokens: int, num_q: int, num_kv: int, d: int, pad: bool, gen: torch.Generator
) -> None:
    q, k, v, positions, table, caches, slots = _case(gen, tokens, num_q, num_kv, d, pad)
    rotation = reference.host_rotation(positions, table)
    expected_caches = caches.clone()
    expected = reference.rotary_store_kv(
        q, k, v, positions, table, expected_caches[0], expected_caches[1], slots
    )
    got = ops.rotary_store_kv(q, k, v, positions, table, caches[0], caches[1], slots, rotation=rotation)
    assert torch.equal(got, expected)
    assert torch.equal(caches, expected_caches)


@needs_kernel
def test_the_cpu_prologue_is_taken_and_norms_come_first(monkeypatch: pytest.MonkeyPatch, gen) -> None:
    """With the step's multipliers, an fp32 CPU call goes to C++ (q/k norms, Qwen3's, first in torch);
    multipliers of other positions, gradients wanted or another dtype go to the reference."""
    calls: list[int] = []
    real = cpu_kernels.rotary_store_rows
    monkeypatch.setattr(cpu_kernels, "rotary_store_rows", lambda *a: calls.append(1) or real(*a))
    q, k, v, positions, table, caches, slots = _case(gen, 5, 4, 2, 16, True)
    q_norm, k_norm = torch.rand(16, generator=gen) + 0.5, torch.rand(16, generator=gen) + 0.5
    expected_caches = caches.clone()
    expected = reference.rotary_store_kv(
        q, k, v, positions, table, expected_caches[0], expected_caches[1], slots, q_norm, k_norm, 1e-6
    )
    rotation = reference.host_rotation(positions, table)
    got = ops.rotary_store_kv(
        q, k, v, positions, table, caches[0], caches[1], slots, q_norm, k_norm, 1e-6, rotation
    )
    assert calls == [1] and torch.equal(got, expected) and torch.equal(caches, expected_caches)

    other = reference.host_rotation(positions.clone(), table)
    ops.rotary_store_kv(q, k, v, positions, table, caches[0], caches[1], slots, rotation=other)
    wanting = q.detach().clone().requires_grad_()
    assert not ops._rotary_on_cpu_kernel(wanting, k, v, caches[0], caches[1], positions, table, rotation)
    halves, half_caches = [t.to(torch.bfloat16) for t in (q, k, v)], caches.to(torch.bfloat16)
    ops.rotary_store_kv(*halves, positions, table, half_caches[0], half_caches[1], slots, rotation=rotation)
    assert calls == [1]


@needs_kernel
def test_the_cpu_prologue_refuses_a_slot_past_the_cache(gen: torch.Generator) -> None:
    q, k, v, positions, table, caches, slots = _case(gen, 3, 2, 1, 8, False)
    rotation = reference.host_rotation(positions, table)
    slots[1] = 8 * 16
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_kernels.rotary_store_rows(q, k, v, rotation.cos, rotation.sin, caches[0], caches[1], slots)
