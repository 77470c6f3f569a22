"""benchmarks/served_drift.py's schedule of windows and its table (the runs themselves need a server and
time: the script's smoke run is in benchmarks/RESULTS.md, "Session 30")."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import served_drift  # noqa: E402


def test_the_burst_comes_between_equal_quiet_after_and_rested_windows() -> None:
    windows = served_drift.schedule(3, 8, 256)
    assert [label for label, _ in windows] == ["quiet"] * 3 + ["burst"] + ["after"] * 3 + ["rested"] * 3
    assert {streams for label, streams in windows if label != "burst"} == {8}
    assert dict(windows)["burst"] == 256


def test_the_table_has_a_line_a_window_with_every_phase_offline_and_served() -> None:
    loop = {"step_ms": 1.5} | {phase: 0.25 for phase in served_drift.PHASES}
    row = {"window": 0, "label": "quiet", "streams": 8, "tokens_per_s": 900.0, "offline_tokens_per_s": 1000.0}
    lines = served_drift.table([row | {"loop": loop, "offline_loop": loop}]).splitlines()
    assert len(lines) == 3
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells[:5] == ["0", "quiet", "8", "0.90", "1.5 / 1.5"]
    assert cells[5:] == ["0.25 / 0.25"] * len(served_drift.PHASES)
    assert len(lines[1].split("|")) == len(lines[0].split("|"))
