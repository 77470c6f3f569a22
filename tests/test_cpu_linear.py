"""`layers.linear`: the CPU's few-row and one-row paths give F.linear's result on random inputs; the one-row
path is measured and chosen."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from dspark.runner.models import layers
from dspark.runner.models.layers import CPU_FEW_ROWS, CPU_LINEAR_PATHS, linear, measure_one_row_path


@pytest.mark.parametrize("rows", [1, 2, 3, CPU_FEW_ROWS, CPU_FEW_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    """Every row count around the thresholds, with and without bias, 2-D and 3-D inputs."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    in_features, out_features = 64, 96
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(1, rows, in_features, generator=gen)
    out3 = linear(x3, weight, b)
    assert out3.shape == (1, rows, out_features)
    torch.testing.assert_close(out3, F.linear(x3, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("as_two", [False, True])
def test_one_row_either_path(as_two: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row gives F.linear's result by either path, contiguous, 2-D and 3-D."""
    monkeypatch.setattr(CPU_LINEAR_PATHS, "one_row_as_two", as_two)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = torch.randn(300, 128, generator=gen)
    b = torch.randn(300, generator=gen)
    for x in (torch.randn(1, 128, generator=gen), torch.randn(1, 1, 128, generator=gen)):
        got = linear(x, weight, b)
        assert got.shape == (*x.shape[:-1], 300) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_the_one_row_path_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_one_row_path keeps whichever path timed faster over the module's weights: made slower
    by a patched F.linear, the GEMV loses; made slower mm, two rows lose."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    real_mm, real_linear = torch.mm, F.linear

    def slow(fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            time.sleep(0.002)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(CPU_LINEAR_PATHS, "one_row_as_two", False)
    monkeypatch.setattr(layers.F, "linear", slow(real_linear))
    assert measure_one_row_path(module) is True and CPU_LINEAR_PATHS.one_row_as_two
    monkeypatch.setattr(layers.F, "linear", real_linear)
    monkeypatch.setattr(layers.torch, "mm", slow(real_mm))
    assert measure_one_row_path(module) is False and not CPU_LINEAR_PATHS.one_row_as_two


def test_the_paths_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows on the CPU go through torch.mm; many rows through F.linear."""
    calls: list[str] = []
    real_mm, real_linear = torch.mm, F.linear
    monkeypatch.setattr(layers.torch, "mm", lambda *a: calls.append("mm") or real_mm(*a))
    monkeypatch.setattr(layers.F, "linear", lambda *a: calls.append("linear") or real_linear(*a))
    weight = torch.randn(8, 4)
    linear(torch.randn(3, 4), weight)
    linear(torch.randn(CPU_FEW_ROWS + 1, 4), weight)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "one_row_as_two", False)
    linear(torch.randn(1, 4), weight)
    monkeypatch.setattr(CPU_LINEAR_PATHS, "one_row_as_two", True)
    linear(torch.randn(1, 4), weight)
    assert calls == ["mm", "linear", "linear", "mm"]
