"""The capacity variants' table: drafter cost per step against held-out tau, one row per variant.

    python3 training/variants_table.py WORK [VARIANT ...] > variants.md

Reads what `variants.sh` leaves in WORK/<variant>/: drafter/config.json, drafter/train_log.jsonl,
cost.json (`dspark draft-cost`), calibration.json (`dspark calibrate-draft`: teacher-forced survival on
the held-out responses) and eval.json (`dspark eval-acceptance`: tau through the engine, greedy). A
variant missing some of them (a run cut at its deadline) gets dashes there. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _log_entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def variant_row(folder: Path) -> dict:
    """What the table shows of one variant (None where it was not measured)."""
    config = _read(folder / "drafter" / "config.json") or {}
    cost = _read(folder / "cost.json") or {}
    calibration = _read(folder / "calibration.json") or {}
    evaluation = _read(folder / "eval.json") or {}
    log = _log_entries(folder / "drafter" / "train_log.jsonl")
    last = log[-1] if log else {}
    ms = cost.get("ms_per_step", {})
    greedy = [row for row in evaluation.get("rows", []) if row["temperature"] == 0]
    return {
        "variant": folder.name,
        "layers": config.get("num_hidden_layers"),
        "target_layers": config.get("target_layer_ids"),
        "rank": config.get("markov_rank"),
        "params_m": cost["parameters"] / 1e6 if "parameters" in cost else None,
        "mb": cost.get("megabytes"),
        "ms": dict(ms),
        "steps": last.get("step"),
        "losses": [(entry["step"], entry["loss"]) for entry in log if "loss" in entry and "step" in entry],
        "tau_tf": calibration.get("tau_teacher_forced"),
        "engine_tau": {row["domain"]: row["tau"] for row in greedy},
    }


def common_steps(rows: list[dict]) -> int | None:
    """The training steps every variant with a log reached (a time cap may stop them apart)."""
    steps = [row["steps"] for row in rows if row["steps"]]
    return min(steps) if steps else None


def loss_up_to(row: dict, steps: int) -> float | None:
    """The mean of the training losses a variant logged over the second half of its first `steps`
    steps: variants compared at equal training, where their tau columns may not be (one logged loss
    is one batch's, too noisy alone)."""
    losses = [loss for step, loss in row["losses"] if steps / 2 < step <= steps]
    return sum(losses) / len(losses) if losses else None


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table, with each variant's tau and cost against the first row's; its
    training loss at the steps all variants reached, and a note when their steps differ."""
    batches = sorted({b for row in rows for b in row["ms"]}, key=int)
    common = common_steps(rows)
    domains = sorted({d for row in rows for d in row["engine_tau"]} - {"all"}) + ["all"]
    head = [
        "variant",
        "layers",
        "target layers",
        "Markov rank",
        "params (M)",
        "MB",
        *[f"drafter ms/step b{b}" for b in batches],
        "steps",
        f"train loss, steps {common // 2 + 1}-{common}" if common else "train loss",
        "held-out tau (teacher forced)",
        *[f"engine tau {d}" for d in domains],
        "Δ engine tau all",
        *[f"Δ ms b{b}" for b in batches],
    ]
    base = rows[0] if rows else None

    def num(value: float | None, digits: int) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    def delta(row: dict, get) -> str:  # noqa: ANN001
        if base is None or get(row) is None or get(base) is None:
            return "–"
        return f"{get(row) - get(base):+.3f}"

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [
            row["variant"],
            str(row["layers"] or "–"),
            ",".join(map(str, row["target_layers"] or [])) or "–",
            str(row["rank"] if row["rank"] is not None else "–"),
            num(row["params_m"], 2),
            num(row["mb"], 1),
            *[num(row["ms"].get(b), 3) for b in batches],
            str(row["steps"] or "–"),
            num(loss_up_to(row, common) if common else None, 3),
            num(row["tau_tf"], 3),
            *[num(row["engine_tau"].get(d), 3) for d in domains],
            delta(row, lambda r: r["engine_tau"].get("all")),
            *[delta(row, lambda r, b=b: r["ms"].get(b)) for b in batches],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    reached = {row["steps"] for row in rows if row["steps"]}
    if len(reached) > 1:
        lines.append(
            f"\nThe variants trained {min(reached)}-{max(reached)} steps (a time cap stopped them apart): "
            f"their tau columns compare unequal training; the loss column compares steps up to {common}."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """Print the table of WORK's variants (all its folders with a drafter, or the ones named)."""
    work = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in work.iterdir() if (p / "drafter").is_dir())
    print(markdown([variant_row(work / name) for name in names if (work / name).is_dir()]), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
