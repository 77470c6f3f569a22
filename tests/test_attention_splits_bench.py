"""benchmarks/attention_splits.py on toy sizes in Triton's interpreter: every split count of each config
agrees with one split (and one split with the reference), and the tables are written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_splits  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; a GPU runs the benchmark itself")
def test_the_split_benchmark_checks_every_split_count_on_toy_sizes(tmp_path):
    assert attention_splits.main(["--tiny", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["batch"], r["window"], r["context"]) for r in rows] == [(1, 1, 40), (2, 3, 24)]
    for row in rows:
        assert {"1", "2", "4", str(row["chosen"])} == set(row["splits"])
        assert all(entry["rel_err_vs_one_split"] <= 2e-5 for entry in row["splits"].values())
    assert "| 2 | 3 | 24 |" in (tmp_path / "results.md").read_text()


def test_configs_parse_with_and_without_a_window():
    assert attention_splits.parse_configs("1x1x1024, 8x4096,2x3x40") == [
        (1, 1, 1024),
        (8, 1, 4096),
        (2, 3, 40),
    ]
