"""`layers.linear`: every CPU path of every few-row count gives F.linear's result on random inputs; the
paths are measured per row count and taken."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from dspark.runner.models import layers
from dspark.runner.models.layers import (
    AS_TWO_ROWS,
    BY_LINEAR,
    CPU_FEW_ROWS,
    CPU_LINEAR_PATHS,
    PACKED,
    WEIGHT_FIRST,
    candidates,
    linear,
    measure_cpu_linear_paths,
    pack_cpu_weights,
    packs_on_this_cpu,
)

# MKL's packed GEMM is in every x86 CPU build of torch (this project's machines and CI): its tests run.
needs_mkl = pytest.mark.skipif(not packs_on_this_cpu(), reason="this torch has no MKL packed GEMM")


def _every_row_count(path_of: dict[int, str]) -> tuple[str, ...]:
    return tuple(path_of.get(rows, BY_LINEAR) for rows in range(1, CPU_FEW_ROWS + 1))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, CPU_FEW_ROWS, CPU_FEW_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path of every row count around the thresholds, with and without bias, 2-D and 3-D inputs:
    F.linear's values, shape, contiguous."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    in_features, out_features = 64, 96
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = pack_cpu_weights([weight])
    for path in candidates(rows, packed) if rows <= CPU_FEW_ROWS else (BY_LINEAR,):
        monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", _every_row_count({rows: path}))
        for x in (
            torch.randn(rows, in_features, generator=gen),
            torch.randn(1, rows, in_features, generator=gen),
        ):
            got = linear(x, weight, b)
            assert got.shape == (*x.shape[:-1], out_features) and got.is_contiguous(), path
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_the_paths_are_measured_per_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_cpu_linear_paths keeps whichever path timed faster over the module's weights, for each
    row count: made slower F.linear loses everywhere, made slower mm wins nowhere; the choice is what
    `linear` takes; a module of the same shapes takes the earlier choice without timing again."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    real_mm, real_linear = torch.mm, F.linear
    calls = {"mm": 0}

    def slow(fn, count: str | None = None):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if count:
                calls[count] += 1
            time.sleep(0.01)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(layers, "_MEASURED", {})
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", CPU_LINEAR_PATHS.by_rows)
    monkeypatch.setattr(layers, "packs_on_this_cpu", lambda: False)  # the packed path: its own tests
    monkeypatch.setattr(layers.F, "linear", slow(real_linear))
    chosen = measure_cpu_linear_paths(module)
    assert chosen == CPU_LINEAR_PATHS.by_rows == (AS_TWO_ROWS,) + (WEIGHT_FIRST,) * (CPU_FEW_ROWS - 1)

    monkeypatch.setattr(layers, "_MEASURED", {})
    monkeypatch.setattr(layers.F, "linear", real_linear)
    monkeypatch.setattr(layers.torch, "mm", slow(real_mm, "mm"))
    assert measure_cpu_linear_paths(module) == (BY_LINEAR,) * CPU_FEW_ROWS == CPU_LINEAR_PATHS.by_rows
    timed = calls["mm"]
    assert timed > 0
    same_shapes = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    assert measure_cpu_linear_paths(same_shapes) == (BY_LINEAR,) * CPU_FEW_ROWS
    assert calls["mm"] == timed, "a model of the same shapes was timed again"


def test_the_paths_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row count goes the way its entry says; many rows through F.linear."""
    calls: list[str] = []
    real_mm, real_linear = torch.mm, F.linear
    monkeypatch.setattr(layers.torch, "mm", lambda *a: calls.append("mm") or real_mm(*a))
    monkeypatch.setattr(layers.F, "linear", lambda *a: calls.append("linear") or real_linear(*a))
    weight = torch.randn(8, 4)
    paths = _every_row_count({1: AS_TWO_ROWS, 3: WEIGHT_FIRST, 4: BY_LINEAR})
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", paths)
    for rows in (1, 3, 4, CPU_FEW_ROWS + 1):
        linear(torch.randn(rows, 4), weight)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", _every_row_count({}))
    linear(torch.randn(1, 4), weight)
    assert calls == ["mm", "mm", "linear", "linear", "linear"]


def _fake_pass_times(cost: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each product by a path advances a fake clock by `cost[path]`; nothing measured before."""
    clock = [0.0]

    def product(flat: torch.Tensor, weight: torch.Tensor, path: str) -> None:
        clock[0] += cost[path]

    monkeypatch.setattr(layers, "_product", product)
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(layers, "_MEASURED", {})
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", CPU_LINEAR_PATHS.by_rows)


@pytest.mark.parametrize(("weight_first_share", "chosen"), [(0.95, BY_LINEAR), (0.85, WEIGHT_FIRST)])
def test_another_path_is_taken_only_when_it_clearly_wins(
    weight_first_share: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pass times set by a fake clock: a path a little faster than F.linear (within CLEAR_WIN) is
    not taken, one clearly faster is."""
    _fake_pass_times(
        {BY_LINEAR: 1.0, WEIGHT_FIRST: weight_first_share, AS_TWO_ROWS: 2.0, PACKED: 2.0}, monkeypatch
    )
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert paths == (BY_LINEAR,) + (chosen,) * (CPU_FEW_ROWS - 1)


@needs_mkl
@pytest.mark.parametrize(("packed_share", "chosen"), [(1.0, BY_LINEAR), (0.95, BY_LINEAR), (0.5, PACKED)])
def test_the_packed_path_is_taken_where_it_clearly_wins(
    packed_share: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fake clock: the packed path is taken only where it clearly beats F.linear (CLEAR_WIN), as any
    other path; a module whose packed path is taken nowhere keeps no packed copies."""
    _fake_pass_times({BY_LINEAR: 1.0, WEIGHT_FIRST: 2.0, AS_TWO_ROWS: 2.0, PACKED: packed_share}, monkeypatch)
    module = torch.nn.Linear(8, 16)
    assert measure_cpu_linear_paths(module) == (chosen,) * CPU_FEW_ROWS
    assert hasattr(module.weight, "mkl_packed") == (chosen == PACKED)


@needs_mkl
def test_a_packed_row_is_that_row_computed_alone_to_rounding() -> None:
    """Each row of a packed product is that row computed alone, to fp32 rounding, at every few-row
    count, and the product is F.linear's. (Bit for bit only on some CPUs: Intel's MKL on the Xeon gave
    every row exactly; on an AMD EPYC rows differ by up to ~15 units in the last place from 4 rows on,
    as F.linear's do from 2 on every CPU seen: a verify window's rows round as decode rows only there.)"""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = torch.randn(384, 256, generator=gen)
    assert pack_cpu_weights([weight])
    for rows in range(1, CPU_FEW_ROWS + 1):
        x = torch.randn(rows, 256, generator=gen)
        together = layers._product(x, weight, PACKED)
        alone = torch.cat([layers._product(x[r : r + 1], weight, PACKED) for r in range(rows)])
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4, msg=f"{rows} rows")
        torch.testing.assert_close(together, F.linear(x, weight), rtol=1e-4, atol=1e-4)


@needs_mkl
def test_weights_are_packed_only_where_the_copies_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """No packed copies when they would take more than PACKED_MEMORY_SHARE of the available memory, for
    half-precision weights, or without MKL; the packed path of an unpacked weight is F.linear."""
    weight = torch.randn(64, 32)
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 4 * weight.numel() * 4)
    assert not pack_cpu_weights([weight]) and not hasattr(weight, "mkl_packed")
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 1 << 40)
    assert not pack_cpu_weights([weight.to(torch.bfloat16)])
    assert pack_cpu_weights([weight]) and hasattr(weight, "mkl_packed")
    x, other = torch.randn(3, 32), torch.randn(64, 32)
    torch.testing.assert_close(layers._product(x, other, PACKED), F.linear(x, other))
    monkeypatch.setattr(layers, "packs_on_this_cpu", lambda: False)
    assert not pack_cpu_weights([torch.randn(64, 32)])
