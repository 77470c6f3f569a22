"""The CPU kernel (`dspark.kernels.cpu.linear`): F.linear's values on random inputs of ragged shapes and
row counts (both tilings: few rows and blocks of many), each output the same bits whatever rows are beside
it, and `layers.linear` taking it for every row count or none, never where gradients are wanted."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.cpu import linear as cpu_linear
from dspark.runner.models import layers
from dspark.runner.models.layers import (
    BY_LINEAR,
    CPU_FEW_ROWS,
    CPU_LINEAR_PATHS,
    KERNEL,
    KERNEL_TOLERANCE,
    ONE_ROW_TOLERANCE,
    ONEDNN,
    WEIGHT_FIRST,
    linear,
    measure_cpu_linear_paths,
)
from dspark.runner.models.measured_paths import MeasuredPaths

# Where this machine can build it (x86-64, AVX2, a C++ compiler: this project's machines and CI) the
# kernel must build and its tests run; elsewhere they say why they skip.
REASON = cpu_linear.why_not()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"no CPU kernel here: {REASON}")


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs each run (the seed is printed on failure by pytest's repr of the case)."""
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@needs_kernel
def test_the_kernel_builds_where_it_can() -> None:
    assert cpu_linear.available(), "x86-64, AVX2 and a compiler, yet the kernel did not build (see the log)"


@needs_kernel
@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 16, 17, 63, 577])
@pytest.mark.parametrize("n", [1, 3, 7, 97, 197])
def test_the_kernel_gives_f_linear_values(k: int, n: int, gen: torch.Generator) -> None:
    """Rows 0..17 and 31..33 (the few-row tiling's tiles and remainders, and the first blocked count), 40
    and 131 (blocks of 4 rows and their remainders), inputs of every width around the 8- and 16-lane
    steps, output counts around the tiles' weight rows and the blocks' (96 or 48)."""
    weight = torch.randn(n, k, generator=gen)
    for rows in (*range(0, 18), 31, 32, 33, 40, 131):
        x = torch.randn(rows, k, generator=gen)
        got = cpu_linear.linear_rows(x, weight)
        assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4, msg=f"{rows}x{k}x{n}")


@needs_kernel
@pytest.mark.parametrize("k", [9, 576, 1536])
def test_each_row_is_the_same_bits_alone_or_beside_others(k: int, gen: torch.Generator) -> None:
    """A row computed alone, in a window of 2-17 or 31-33 rows at any place in it, or among 64 or 203 (a
    prefill chunk's blocked tiling over ragged weight-row counts): the same bits (what
    keeps a verify window's rows, and a decode row beside a prefill chunk, equal to plain decode rows)."""
    weight = torch.randn(200, k, generator=gen)
    x = torch.randn(203, k, generator=gen)
    alone = torch.cat([cpu_linear.linear_rows(x[r : r + 1].contiguous(), weight) for r in range(203)])
    assert torch.equal(cpu_linear.linear_rows(x, weight), alone)
    assert torch.equal(cpu_linear.linear_rows(x[:64].contiguous(), weight), alone[:64])
    assert torch.equal(cpu_linear.linear_rows(x[:, :].contiguous(), weight[:97].contiguous()), alone[:, :97])
    for rows in (*range(2, 18), 31, 32, 33):
        for start in (0, max(17 - rows, 1), 150):
            window = cpu_linear.linear_rows(x[start : start + rows].contiguous(), weight)
            assert torch.equal(window, alone[start : start + rows]), (rows, start)


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_take() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.linear_rows(torch.randn(2, 8).double(), torch.randn(4, 8).double())
    with pytest.raises(RuntimeError, match="x \\[rows, k\\]"):
        cpu_linear.linear_rows(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_linear.linear_rows(torch.randn(8, 2).t(), torch.randn(4, 8))


def _times(kernel: list[float], other: list[float]) -> list[dict[str, float]]:
    return [{KERNEL: k, ONEDNN: o, BY_LINEAR: 2 * o} for k, o in zip(kernel, other, strict=True)]


def test_the_kernel_takes_every_row_count_or_none() -> None:
    """All or nothing: over the few-row counts together it must be no slower, at one row tie at worst
    (ONE_ROW_TOLERANCE) and stay within KERNEL_TOLERANCE at every other count (the last, a prefill
    chunk's, included); one count past that, or slower overall, and no count takes it."""
    other = [1.0] * (CPU_FEW_ROWS + 1)
    assert layers._kernel_takes_all(_times([0.5] * (CPU_FEW_ROWS + 1), other))
    within = [ONE_ROW_TOLERANCE * 0.99] + [0.5] * (CPU_FEW_ROWS - 1) + [KERNEL_TOLERANCE * 0.99]
    assert layers._kernel_takes_all(_times(within, other))
    for count in range(1, CPU_FEW_ROWS + 1):
        slow = [0.5] * (CPU_FEW_ROWS + 1)
        slow[count] = KERNEL_TOLERANCE * 1.01
        assert not layers._kernel_takes_all(_times(slow, other)), count
    one_row_loss = [ONE_ROW_TOLERANCE * 1.01] + [0.5] * CPU_FEW_ROWS
    assert not layers._kernel_takes_all(_times(one_row_loss, other))
    tie = [0.99] * (CPU_FEW_ROWS + 1)  # a tie goes to the kernel (its sums make speculation exact)
    assert layers._kernel_takes_all(_times(tie, other))
    slower = [1.02] * (CPU_FEW_ROWS + 1)  # within every tolerance, but slower together
    assert not layers._kernel_takes_all(_times(slower, other))
    assert not layers._kernel_takes_all([])


def _fake_measure(monkeypatch: pytest.MonkeyPatch, kernel_seconds) -> None:
    """measure_cpu_linear_paths with pass times set by a fake clock: `kernel_seconds(rows)` per kernel
    product, F.linear 1.0, the weight first 0.8, anything else 3.0."""
    for name in ("by_rows", "many_rows", "unpacked_by_rows", "unpacked_many_rows"):
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(CPU_LINEAR_PATHS, name))
    monkeypatch.setattr(layers, "_PATHS_BY_DTYPE", {torch.float32: CPU_LINEAR_PATHS})
    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths())
    monkeypatch.setattr(layers, "COPY_ATTRIBUTE", {})
    monkeypatch.setattr(layers, "kernel_here", lambda: True)
    clock = [0.0]

    def product(flat: torch.Tensor, weight: torch.Tensor, path: str) -> None:
        rows = flat.shape[0]
        if path == KERNEL:
            clock[0] += kernel_seconds(rows)
        else:
            clock[0] += {BY_LINEAR: 1.0, WEIGHT_FIRST: 0.8}.get(path, 3.0)

    monkeypatch.setattr(layers, "_product", product)
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock[0])


def test_the_measured_choice_takes_the_kernel_for_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_cpu_linear_paths over fp32 weights: a kernel ahead at every count takes every count, prefill
    rows included; the unpacked choice (for gradients) stays the library's; bf16 weights never time it."""
    _fake_measure(monkeypatch, lambda rows: 0.5)
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert paths.by_rows == (KERNEL,) * CPU_FEW_ROWS and paths.many_rows == KERNEL
    assert paths.unpacked_by_rows == (BY_LINEAR,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    assert paths.unpacked_many_rows == BY_LINEAR
    bf16 = measure_cpu_linear_paths(torch.nn.Linear(8, 16).to(torch.bfloat16))
    assert KERNEL not in (*bf16.by_rows, bf16.many_rows)


def test_a_kernel_slow_at_prefill_takes_no_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ahead at every few-row count but slow for a prefill chunk: not taken anywhere (never for a range of
    counts), the library's best per count instead."""
    _fake_measure(monkeypatch, lambda rows: 0.5 if rows <= CPU_FEW_ROWS else 2.0)
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert KERNEL not in (*paths.by_rows, paths.many_rows)
    assert paths.by_rows == (BY_LINEAR,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)
    assert paths.many_rows == BY_LINEAR


@needs_kernel
def test_linear_takes_the_kernel_and_leaves_it_where_gradients_are_wanted(
    monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """With the kernel chosen for every row count: `linear` gives F.linear's values through it (3-D and
    strided inputs, and prefill rows, too); an input or a weight that wants gradients takes the unpacked
    choice, and the gradients flow."""
    for name in ("by_rows", "many_rows", "unpacked_by_rows", "unpacked_many_rows"):
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(CPU_LINEAR_PATHS, name))
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", (KERNEL,) * CPU_FEW_ROWS)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "many_rows", KERNEL)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "unpacked_by_rows", (WEIGHT_FIRST,) * CPU_FEW_ROWS)
    taken: list[str] = []
    real = layers._product
    monkeypatch.setattr(layers, "_product", lambda x, w, p: taken.append(p) or real(x, w, p))
    weight = torch.randn(96, 64, generator=gen)
    for x in (torch.randn(3, 64, generator=gen), torch.randn(1, 4, 64, generator=gen)):
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(64, 5, generator=gen).t()
    torch.testing.assert_close(linear(strided, weight), F.linear(strided, weight), rtol=1e-5, atol=1e-5)
    prefill = torch.randn(CPU_FEW_ROWS + 21, 64, generator=gen)
    torch.testing.assert_close(linear(prefill, weight), F.linear(prefill, weight), rtol=1e-5, atol=1e-5)
    assert taken == [KERNEL] * 4
    taken.clear()
    wanting = torch.randn(2, 64, generator=gen).requires_grad_()
    linear(wanting, weight).sum().backward()
    torch.testing.assert_close(wanting.grad, weight.sum(0).expand(2, -1), rtol=1e-5, atol=1e-5)
    trained = weight.clone().requires_grad_()
    linear(torch.ones(2, 64), trained).sum().backward()
    assert trained.grad is not None
    assert taken == [WEIGHT_FIRST, WEIGHT_FIRST]


def test_a_stale_build_lock_is_removed_and_a_failed_build_leaves_the_library(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock left by a process killed mid-build (older than STALE_LOCK_S) is removed before building, a
    fresh one is left to its builder; a build that fails makes the kernel unavailable, once, not an
    error."""
    import torch.utils.cpp_extension as extension

    monkeypatch.setattr(cpu_linear, "_module", None)
    monkeypatch.setattr(cpu_linear, "_tried", False)
    monkeypatch.setattr(cpu_linear, "why_not", lambda: None)
    monkeypatch.setattr(cpu_linear, "build_directory", lambda: tmp_path)
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cpu_linear.STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    seen: list[bool] = []

    def failing_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(lock.exists())
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(extension, "load", failing_build)
    assert not cpu_linear.available() and not cpu_linear.available()
    assert seen == [False], "the stale lock was there at the build, or the build was tried twice"

    monkeypatch.setattr(cpu_linear, "_tried", False)
    lock.touch()  # fresh: another process is building
    assert not cpu_linear.available()
    assert seen == [False, True]


def test_the_build_folder_follows_torch_extensions_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_EXTENSIONS_DIR places the build as it places torch's own; one folder per torch, Python and
    vector width (an AVX-512 build must not load on a CPU without it)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_linear.build_directory()
    assert folder.parent == tmp_path and torch.__version__.split("+")[0] in folder.name
    assert folder.name.endswith("_" + cpu_linear.isa()) and cpu_linear.isa() in ("avx512", "avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_linear.build_directory().name.endswith("_avx2") and cpu_linear.isa() == "avx2"


def test_no_extension_builder_leaves_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's extension builder imports setuptools, which a bare venv may lack: the import failing makes
    the kernel unavailable (a model still loads), not an error."""
    import sys

    monkeypatch.setattr(cpu_linear, "_module", None)
    monkeypatch.setattr(cpu_linear, "_tried", False)
    monkeypatch.setattr(cpu_linear, "why_not", lambda: None)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # import raises ImportError
    assert not cpu_linear.available()


@needs_kernel
@pytest.mark.parametrize("k", [1, 9, 577])
@pytest.mark.parametrize("n", [1, 13, 200])
def test_silu_mul_rows_is_the_product_then_swiglu(k: int, n: int, gen: torch.Generator) -> None:
    """The gate/up product with SwiGLU in its epilogue: silu(x Wg^T) * (x Wu^T) of `linear_rows`' own
    products within fp32 rounding, at every tiling's row counts, odd widths (the epilogue's tail)."""
    weight = torch.randn(2 * n, k, generator=gen) / k**0.5
    for rows in (0, 1, 3, 8, 12, 13, 17, 131):
        x = torch.randn(rows, k, generator=gen) * 3
        got = cpu_linear.silu_mul_rows(x, weight)
        gate, up = cpu_linear.linear_rows(x, weight).chunk(2, dim=-1)
        assert got.shape == (rows, n) and got.is_contiguous()
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6, msg=f"{rows}x{k}x{n}")


@needs_kernel
def test_silu_mul_rows_of_a_row_are_the_same_bits_alone_or_beside_others(gen: torch.Generator) -> None:
    weight = torch.randn(2 * 1536, 576, generator=gen) / 24
    x = torch.randn(70, 576, generator=gen)
    alone = torch.cat([cpu_linear.silu_mul_rows(x[r : r + 1].contiguous(), weight) for r in range(70)])
    for rows in (2, 4, 13, 70):
        assert torch.equal(cpu_linear.silu_mul_rows(x[:rows].contiguous(), weight), alone[:rows]), rows
    # Far outside the exponential's range: saturates like silu (x for large x, -0 for very negative x).
    extreme = torch.tensor([[-200.0, -90.0, -1.0, 0.0, 1.0, 90.0, 200.0, 3.0, 5.0]])
    eye = torch.cat([torch.eye(9), torch.eye(9)])
    torch.testing.assert_close(cpu_linear.silu_mul_rows(extreme, eye), F.silu(extreme) * extreme)
    with pytest.raises(RuntimeError, match="gate rows then as many up rows"):
        cpu_linear.silu_mul_rows(torch.randn(2, 8), torch.randn(5, 8))


@needs_kernel
@pytest.mark.parametrize("h", [1, 7, 8, 9, 576, 577])
def test_rms_norm_rows_is_torchs_rms_norm(h: int, gen: torch.Generator) -> None:
    """With and without the residual: F.rms_norm's values (of x + residual, which comes back exactly), for
    one row, a few and more than one thread's share (64)."""
    weight = torch.randn(h, generator=gen)
    for rows in (0, 1, 4, 17, 130):
        x, residual = torch.randn(rows, h, generator=gen), torch.randn(rows, h, generator=gen)
        normed, summed = cpu_linear.rms_norm_rows(x, weight, 1e-5, residual)
        assert torch.equal(summed, x + residual)
        expected = F.rms_norm(x + residual, (h,), weight, 1e-5)
        torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)
        normed, none = cpu_linear.rms_norm_rows(x, weight, 1e-5)
        assert none is None
        torch.testing.assert_close(normed, F.rms_norm(x, (h,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rms_norm_rows_of_a_row_are_the_same_bits_alone_or_beside_others(gen: torch.Generator) -> None:
    weight = torch.randn(576, generator=gen)
    x, residual = torch.randn(130, 576, generator=gen), torch.randn(130, 576, generator=gen)
    every = cpu_linear.rms_norm_rows(x, weight, 1e-6, residual)[0]
    for r in (0, 5, 64, 129):
        alone = cpu_linear.rms_norm_rows(
            x[r : r + 1].contiguous(), weight, 1e-6, residual[r : r + 1].contiguous()
        )
        assert torch.equal(alone[0], every[r : r + 1]), r


@needs_kernel
def test_cpu_norms_and_gate_up_projections_take_the_extension(
    monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """ops.rms_norm takes the C++ norm for fp32 CPU tensors (3-D too) and the reference where gradients
    are wanted or the dtype is not fp32; a gate/up projection takes the fused epilogue where `linear` takes
    the kernel for its rows, the product then silu_mul where it does not."""
    from dspark.kernels import ops

    calls: list[str] = []
    real_norm, real_silu = cpu_linear.rms_norm_rows, cpu_linear.silu_mul_rows
    monkeypatch.setattr(cpu_linear, "rms_norm_rows", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(cpu_linear, "silu_mul_rows", lambda *a: calls.append("silu_mul") or real_silu(*a))
    x, residual, weight = (
        torch.randn(2, 3, 64, generator=gen),
        torch.randn(2, 3, 64, generator=gen),
        torch.randn(64),
    )
    normed, summed = ops.rms_norm(x, weight, 1e-6, residual)
    assert calls == ["norm"] and summed.shape == x.shape and torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (64,), weight, 1e-6), rtol=1e-5, atol=1e-5)
    calls.clear()
    ops.rms_norm(x.clone().requires_grad_(), weight, 1e-6)
    ops.rms_norm(x.double(), weight.double(), 1e-6)
    assert calls == []

    for name in ("by_rows", "many_rows", "unpacked_by_rows", "unpacked_many_rows"):
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(CPU_LINEAR_PATHS, name))
    gate_up = torch.randn(2 * 48, 64, generator=gen) / 8
    expected = F.silu(F.linear(x, gate_up[:48])) * F.linear(x, gate_up[48:])
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", (KERNEL,) * CPU_FEW_ROWS)
    torch.testing.assert_close(layers.silu_mul_linear(x, gate_up), expected, rtol=1e-5, atol=1e-5)
    assert calls == ["silu_mul"]
    calls.clear()
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", (BY_LINEAR,) * CPU_FEW_ROWS)
    torch.testing.assert_close(layers.silu_mul_linear(x, gate_up), expected, rtol=1e-5, atol=1e-5)
    assert calls == []
