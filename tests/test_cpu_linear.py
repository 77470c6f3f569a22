"""`layers.linear`: the CPU's few-row and large-weight paths give F.linear's result on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.runner.models import layers
from dspark.runner.models.layers import CPU_FEW_ROWS, CPU_LARGE_WEIGHT, linear


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


def test_one_row_against_a_large_weight() -> None:
    """One row against a weight of CPU_LARGE_WEIGHT elements or more takes the two-row path."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    in_features = 256
    out_features = CPU_LARGE_WEIGHT // in_features
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(1, in_features, generator=gen)
    got = linear(x, weight)
    assert got.shape == (1, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_the_paths_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows on the CPU go through torch.mm; many rows through F.linear."""
    calls: list[str] = []
    real_mm, real_linear = torch.mm, F.linear
    monkeypatch.setattr(layers.torch, "mm", lambda *a: calls.append("mm") or real_mm(*a))
    monkeypatch.setattr(layers.F, "linear", lambda *a: calls.append("linear") or real_linear(*a))
    weight = torch.randn(8, 4)
    linear(torch.randn(3, 4), weight)
    linear(torch.randn(CPU_FEW_ROWS + 1, 4), weight)
    linear(torch.randn(1, 4), weight)
    assert calls == ["mm", "linear", "linear"]
