"""Confidence calibration: one temperature per block position, fitted left to right on held-out data.

The planner trusts survival a_k = c_1 · … · c_k. Position k's temperature T_k is fitted with T_1..T_{k-1}
already fixed, so that the running product of confidences matches the survival measured at position k
(maximum likelihood; a fine log-spaced grid, then a golden-section refinement).

Measured survival of a block comes from a teacher-forced pass on the target's own text: greedy records
survive while the draft's argmax equals the target's; sampled records survive to position k with
probability Π_j Σ min(p_d, p_t), the acceptance chance of speculative sampling.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.runner.models.llama import CausalLM
from dspark.spec.drafter import Drafter
from dspark.training.data import AnchorSampler, DistillRecord, TrainBatch
from dspark.training.draft_forward import block_hidden, confidence_logits
from dspark.training.losses import BlockTargets
from dspark.training.trainer import block_targets

SURVIVAL_MODES = ("record", "greedy", "sampled")
_EPS = 1e-6


@dataclass
class CalibrationData:
    """Per held-out block: raw confidence logits [N, block_size] and measured survival [N, block_size]
    in [0, 1]."""

    logits: torch.Tensor
    survival: torch.Tensor


@torch.no_grad()
def teacher_forced_blocks(
    target: CausalLM, drafter: Drafter, batch: TrainBatch, vocab: torch.Tensor | None = None
) -> tuple[BlockTargets, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A batch's blocks drafted teacher-forced (each position's previous token the true one): what they
    are checked against, the drafter's final states [N, block_size, hidden], the Markov features of the
    previous tokens and the corrected logits over the whole vocabulary [N, block_size, vocab] fp32 (with
    `vocab`, the draft vocabulary's sorted ids: -inf outside it, as the engine drafts)."""
    cfg = drafter.config
    features, targets = block_targets(target, batch, cfg.block_size, list(cfg.target_layer_ids))
    hidden = block_hidden(
        drafter, target.embed_tokens.weight, features, batch.token_ids, batch.anchors
    ).flatten(0, 1)
    markov = drafter.markov_features(targets.previous)
    base = torch.nn.functional.linear(hidden, target.lm_head.weight.to(hidden.dtype)).float()
    logits = drafter.corrected_logits(base, markov)
    if vocab is not None:
        outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        outside[vocab.to(logits.device)] = False
        logits = logits.masked_fill(outside, float("-inf"))
    return targets, hidden, markov, logits


@torch.no_grad()
def collect_calibration_data(
    target: CausalLM,
    drafter: Drafter,
    records: list[DistillRecord],
    anchors_per_sequence: int,
    batch_size: int,
    max_length: int,
    seed: int,
    mode: str = "record",
    vocab: torch.Tensor | None = None,
) -> CalibrationData:
    """Confidence logits and measured survival of whole blocks drawn from `records`.

    mode: "record" measures each record in its own decoding (greedy at temperature 0, else sampled);
    "greedy" or "sampled" measures every record that way. vocab: the draft vocabulary's sorted token ids
    the drafts come from (None: every token).
    """
    if mode not in SURVIVAL_MODES:
        raise ValueError(f"mode: must be one of {', '.join(SURVIVAL_MODES)}, got {mode!r}")
    cfg = drafter.config
    block_size = cfg.block_size
    device = drafter.fc.weight.device
    sampler = AnchorSampler(
        records, batch_size, anchors_per_sequence, max_length, seed, min_following=block_size
    )
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    all_logits, all_survival = [], []
    for picks, batch in sampler.one_pass():
        batch = batch.to(device)
        with amp:
            targets, hidden, markov, logits = teacher_forced_blocks(target, drafter, batch, vocab)
            conf = confidence_logits(drafter, hidden, markov)
        greedy_hit = (logits.argmax(-1) == targets.target_logits.argmax(-1)).float()
        overlap = torch.minimum(torch.softmax(logits, -1), torch.softmax(targets.target_logits.float(), -1))
        sampled_accept = overlap.sum(-1).clamp(0.0, 1.0)
        temps = torch.tensor([sampler.sequences[i][2] for i in picks], device=device)
        is_greedy = (temps == 0).repeat_interleave(batch.anchors.shape[1])[:, None]
        if mode != "record":
            is_greedy = torch.full_like(is_greedy, mode == "greedy")
        accept = torch.where(is_greedy, greedy_hit, sampled_accept)
        keep = targets.valid.all(dim=-1)
        all_logits.append(conf[keep].float().cpu())
        all_survival.append(accept[keep].cumprod(dim=-1).cpu())
    return CalibrationData(torch.cat(all_logits), torch.cat(all_survival))


def predicted_survival(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """a_k = Π_{j≤k} sigmoid(logit_j / T_j): [N, block_size]."""
    temps = torch.tensor(temperatures, dtype=logits.dtype)
    return torch.sigmoid(logits / temps).cumprod(dim=-1)


def fit_temperatures(data: CalibrationData, low: float = 0.05, high: float = 20.0) -> list[float]:
    """One temperature per position, left to right, each maximising the likelihood of the measured
    survival under the running product of confidences."""
    prefix = torch.ones(data.logits.shape[0], dtype=torch.float64)
    temperatures: list[float] = []
    for k in range(data.logits.shape[1]):
        logits, survival = data.logits[:, k].double(), data.survival[:, k].double()
        grid = torch.linspace(math.log(low), math.log(high), 61, dtype=torch.float64)
        best = int(_survival_nll(grid, prefix, logits, survival).argmin())
        log_t = _golden_section(
            lambda x, lg=logits, sv=survival, pf=prefix: float(
                _survival_nll(torch.tensor([x], dtype=torch.float64), pf, lg, sv)[0]
            ),
            float(grid[max(best - 1, 0)]),
            float(grid[min(best + 1, len(grid) - 1)]),
        )
        temperatures.append(math.exp(log_t))
        prefix = prefix * torch.sigmoid(logits / temperatures[-1])
    return temperatures


def _survival_nll(
    log_t: torch.Tensor, prefix: torch.Tensor, logits: torch.Tensor, survival: torch.Tensor
) -> torch.Tensor:
    """Mean NLL of survival [N] under prefix · sigmoid(logits / T), for each of the G values of log T: [G]."""
    pred = prefix[:, None] * torch.sigmoid(logits[:, None] / log_t.exp()[None, :])
    pred = pred.clamp(_EPS, 1 - _EPS)
    return -(survival[:, None] * pred.log() + (1 - survival[:, None]) * (1 - pred).log()).mean(0)


def calibration_error(predicted: torch.Tensor, measured: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: sample-weighted mean |mean predicted − mean measured| over equal-width
    bins of the prediction (any shape; all entries pooled)."""
    pred = predicted.flatten().double()
    meas = measured.flatten().double()
    if pred.numel() == 0:
        return float("nan")
    which = (pred * bins).long().clamp(0, bins - 1)
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, pred - meas)
    return float(gap.abs().sum() / pred.numel())


def calibration_report(data: CalibrationData, before: list[float], after: list[float]) -> dict:
    """ECE pooled and per position, and mean predicted vs measured survival, before and after."""
    report: dict = {
        "num_blocks": int(data.logits.shape[0]),
        "temperatures_before": before,
        "temperatures": after,
    }
    report["measured_survival"] = [round(float(s), 4) for s in data.survival.mean(0)]
    # Tokens a step would commit on these blocks, teacher forced: the bonus token plus every survival.
    report["tau_teacher_forced"] = round(1.0 + float(data.survival.mean(0).sum()), 4)
    for name, temps in (("before", before), ("after", after)):
        pred = predicted_survival(data.logits, temps)
        report[f"ece_{name}"] = round(calibration_error(pred, data.survival), 5)
        report[f"ece_per_position_{name}"] = [
            round(calibration_error(pred[:, k], data.survival[:, k]), 5) for k in range(pred.shape[1])
        ]
        report[f"predicted_survival_{name}"] = [round(float(s), 4) for s in pred.mean(0)]
    return report


def write_temperatures(draft_dir: str | Path, temperatures: list[float]) -> None:
    """Store the temperatures as the drafter's config.json `confidence_temperatures`; nothing else changes."""
    path = Path(draft_dir) / "config.json"
    raw = json.loads(path.read_text())
    raw["confidence_temperatures"] = [round(t, 6) for t in temperatures]
    path.write_text(json.dumps(raw, indent=2) + "\n")


def _golden_section(f, lo: float, hi: float, iterations: int = 30) -> float:  # noqa: ANN001
    """The minimiser of a unimodal f on [lo, hi]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2
