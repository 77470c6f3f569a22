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
    WEIGHT_FIRST,
    candidates,
    linear,
    measure_cpu_linear_paths,
)


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
    for path in candidates(rows) if rows <= CPU_FEW_ROWS else (BY_LINEAR,):
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


@pytest.mark.parametrize(("weight_first_share", "chosen"), [(0.95, BY_LINEAR), (0.85, WEIGHT_FIRST)])
def test_another_path_is_taken_only_when_it_clearly_wins(
    weight_first_share: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pass times set by a fake clock: a path a little faster than F.linear (within CLEAR_WIN) is
    not taken, one clearly faster is."""
    clock = [0.0]
    cost = {BY_LINEAR: 1.0, WEIGHT_FIRST: weight_first_share, AS_TWO_ROWS: 2.0}

    def product(flat: torch.Tensor, weight: torch.Tensor, path: str) -> None:
        clock[0] += cost[path]

    monkeypatch.setattr(layers, "_product", product)
    monkeypatch.setattr(layers.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(layers, "_MEASURED", {})
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", CPU_LINEAR_PATHS.by_rows)
    paths = measure_cpu_linear_paths(torch.nn.Linear(8, 16))
    assert paths == (BY_LINEAR,) + (chosen,) * (CPU_FEW_ROWS - 1)
