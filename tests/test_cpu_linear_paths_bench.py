"""benchmarks/cpu_linear_paths.py on the tiny target: a row of every candidate path's time for each row
count, and the choice made at load, which `layers.linear` then takes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dspark.runner.models import layers
from dspark.runner.models.layers import CPU_FEW_ROWS, CPU_LINEAR_PATHS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_linear_paths  # noqa: E402


def test_the_paths_table_covers_every_row_count(tiny_target_dir, capsys, monkeypatch: pytest.MonkeyPatch):
    # Both put back afterwards: the benchmark measures afresh.
    monkeypatch.setattr(CPU_LINEAR_PATHS, "by_rows", CPU_LINEAR_PATHS.by_rows)
    monkeypatch.setattr(layers, "_MEASURED", {})
    assert cpu_linear_paths.main(["--model", str(tiny_target_dir), "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(1, CPU_FEW_ROWS + 1))
    # The candidates of each row count (the packed path too where MKL packs), and the ratio.
    widths = {len(layers.candidates(n, layers.packs_on_this_cpu())) + 2 for n in range(1, CPU_FEW_ROWS + 1)}
    assert {len(row) for row in rows} == widths, rows
    (measured,) = [line for line in lines if line.startswith("measured at load")]
    assert measured.split(": ", 1)[1].split() == [
        f"{n}:{p}" for n, p in enumerate(CPU_LINEAR_PATHS.by_rows, 1)
    ]
