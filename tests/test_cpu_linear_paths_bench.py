"""benchmarks/cpu_linear_paths.py on the tiny target: a row of every candidate path's time for each row
count, and the choice made at load, which `layers.linear` then takes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dspark.runner.models import layers
from dspark.runner.models.layers import CPU_FEW_ROWS, CPU_LINEAR_PATHS, MANY_ROWS
from dspark.runner.models.measured_paths import MeasuredPaths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_linear_paths  # noqa: E402


def test_the_paths_table_covers_every_row_count(tiny_target_dir, capsys, monkeypatch: pytest.MonkeyPatch):
    # Put back afterwards: the benchmark measures afresh.
    for name in ("by_rows", "many_rows", "unpacked_by_rows", "unpacked_many_rows"):
        monkeypatch.setattr(CPU_LINEAR_PATHS, name, getattr(CPU_LINEAR_PATHS, name))
    monkeypatch.setattr(layers, "MEASURED", MeasuredPaths())
    assert cpu_linear_paths.main(["--model", str(tiny_target_dir), "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [*range(1, CPU_FEW_ROWS + 1), MANY_ROWS]
    # The candidates of each row count (the packed paths too where torch has them, the CPU kernel at
    # every count where it runs), and the ratio.
    packed = tuple(path for path in layers.COPY_ATTRIBUTE if layers.packs_on_this_cpu(path))
    kernel = (layers.KERNEL,) if layers.kernel_here() else ()
    for row in rows:
        assert len(row) == len(layers.candidates(int(row[0]), packed + kernel)) + 2, row
    (measured,) = [line for line in lines if line.startswith("measured at load")]
    assert measured.split(": ", 1)[1] == CPU_LINEAR_PATHS.describe()
