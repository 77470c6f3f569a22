"""training/variants_table.py: the capacity table compares variants at the training steps they all
reached, and says so when a time cap stopped them apart."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import variants_table  # noqa: E402


def _variant(work: Path, name: str, losses: dict[int, float], tau: float) -> None:
    drafter = work / name / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "markov_rank": 32}))
    lines = [json.dumps({"step": step, "lr": 1e-3, "loss": loss}) for step, loss in losses.items()]
    (drafter / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    (work / name / "calibration.json").write_text(json.dumps({"tau_teacher_forced": tau}))


def test_the_loss_column_compares_the_steps_every_variant_reached(tmp_path) -> None:
    rng = random.Random()
    short = {s: rng.uniform(6.0, 9.0) for s in range(50, 501, 50)}
    long = {s: rng.uniform(6.0, 9.0) for s in range(50, 701, 50)}
    _variant(tmp_path, "base", short, 1.45)
    _variant(tmp_path, "wider", long, 1.62)
    rows = [variants_table.variant_row(tmp_path / n) for n in ("base", "wider")]
    assert variants_table.common_steps(rows) == 500
    text = variants_table.markdown(rows)
    assert "train loss, steps 251-500" in text
    # Each row's loss: the mean of its logged losses over steps 251-500, the longer run's later ones left out.
    for name, losses in (("base", short), ("wider", long)):
        expected = sum(v for s, v in losses.items() if 250 < s <= 500) / 5
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {expected:.3f} |" in row
    assert "trained 500-700 steps" in text


def test_variants_that_reached_the_same_steps_get_no_note(tmp_path) -> None:
    for name in ("base", "other"):
        _variant(tmp_path, name, {100: 8.0, 200: 7.0}, 1.5)
    rows = [variants_table.variant_row(tmp_path / n) for n in ("base", "other")]
    text = variants_table.markdown(rows)
    assert "| 7.000 |" in text and "trained" not in text
