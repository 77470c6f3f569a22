"""Calibration: the left-to-right fit recovers known per-position temperatures, lowers the calibration
error, and the evaluation measures survival only where the outcome of a draft is known."""

from __future__ import annotations

import pytest
import torch

from dspark.training.acceptance import DraftedBlock, block_survival
from dspark.training.calibration import (
    CalibrationData,
    calibration_error,
    fit_temperatures,
    predicted_survival,
)

TRUE_TEMPERATURES = [0.5, 1.0, 2.0, 0.8, 1.5]


def _synthetic(n: int, seed: int) -> CalibrationData:
    """Blocks whose draft k survives its predecessors with probability sigmoid(logit_k / T_k)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, len(TRUE_TEMPERATURES), generator=g) * 2.5 + 2.0
    accept = torch.rand(logits.shape, generator=g) < torch.sigmoid(logits / torch.tensor(TRUE_TEMPERATURES))
    return CalibrationData(logits, accept.float().cumprod(dim=-1))


@pytest.fixture(scope="module")
def fitted() -> list[float]:
    """Temperatures fitted on synthetic blocks drawn with TRUE_TEMPERATURES."""
    return fit_temperatures(_synthetic(6000, seed=0))


def test_fit_recovers_known_temperatures(fitted) -> None:
    for got, want in zip(fitted, TRUE_TEMPERATURES, strict=True):
        assert abs(got - want) < 0.12 * want


def test_fitted_temperatures_lower_the_calibration_error_on_fresh_data(fitted) -> None:
    fresh = _synthetic(6000, seed=1)
    untuned = calibration_error(predicted_survival(fresh.logits, [1.0] * 5), fresh.survival)
    tuned = calibration_error(predicted_survival(fresh.logits, fitted), fresh.survival)
    assert tuned < 0.5 * untuned and tuned < 0.01


def test_calibration_error_is_the_binned_gap_between_prediction_and_outcome() -> None:
    predicted = torch.tensor([0.05, 0.05, 0.95, 0.95])
    assert calibration_error(predicted, torch.tensor([0.0, 0.0, 1.0, 1.0])) < 0.051
    assert calibration_error(predicted, torch.tensor([1.0, 1.0, 0.0, 0.0])) > 0.9


def _block(tokens: list[int], cap: int = 4) -> DraftedBlock:
    # Drafted when the request held 3 tokens: draft j predicts committed[3 + j].
    return DraftedBlock("r", 3, cap, tokens, [0.9, 0.8, 0.7, 0.6])


def test_greedy_survival_counts_every_position_with_a_known_outcome() -> None:
    committed = [1, 2, 3, 4, 5, 6]
    predicted, measured = block_survival(_block([4, 5, 9, 6]), committed, verified_only=False)
    assert measured == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(torch.tensor(predicted), torch.tensor([0.9, 0.72, 0.504, 0.3024]))
    # Past the committed output, a surviving prefix has no known outcome.
    _, measured = block_survival(_block([4, 5, 6, 7]), committed, verified_only=False)
    assert measured == [1.0, 1.0, 1.0]


def test_sampled_survival_stops_at_the_verified_drafts_unless_already_rejected() -> None:
    committed = [1, 2, 3, 4, 5, 6, 7, 8]
    _, measured = block_survival(_block([4, 5, 6, 7], cap=2), committed, verified_only=True)
    assert measured == [1.0, 1.0]
    _, measured = block_survival(_block([9, 5, 6, 7], cap=2), committed, verified_only=True)
    assert measured == [0.0, 0.0, 0.0, 0.0]
