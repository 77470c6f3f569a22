"""benchmarks/tau_limits.py: where a drafter misses, by the target's own top-1 probability; tau from the
hits as the engine's greedy acceptance counts it (a block's drafts count up to its first miss)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tau_limits  # noqa: E402


def _tau(hits: list[list[bool]]) -> float:
    """1 + the drafts each block commits (up to its first miss), averaged."""
    total = 0
    for block in hits:
        total += next((k for k, hit in enumerate(block) if not hit), len(block))
    return 1.0 + total / len(hits)


def test_tau_and_the_bins_follow_the_hits_and_the_targets_probabilities() -> None:
    rng = random.Random()
    blocks, block_size = rng.randrange(40, 80), 3
    top_p = torch.rand(blocks, block_size)
    hit1 = torch.rand(blocks, block_size) < top_p  # a drafter that hits more where the target is sure
    hit2 = hit1 | (torch.rand(blocks, block_size) < 0.3)
    hit4 = hit2 | (torch.rand(blocks, block_size) < 0.3)
    domains = [rng.choice(["chat", "code"]) for _ in range(blocks)]
    data = {"top_p": top_p, "hit1": hit1, "hit2": hit2, "hit4": hit4, "domain": domains}
    summary = tau_limits.summarize(data, block_size)

    for share in ("share", "share_first"):  # six bins, each rounded to 0.001
        assert abs(sum(row[share] for row in summary["bins"]) - 1.0) < 4e-3
    row = summary["domains"]["all"]
    assert row["blocks"] == blocks
    assert abs(row["tau"] - _tau(hit1.tolist())) < 1e-3
    sure = (hit1 | (top_p >= 0.5)).tolist()
    assert abs(row["tau_if_hit_where_target_ge_0.5"] - _tau(sure)) < 1e-3
    wider = torch.cat([hit2[:, :1], hit1[:, 1:]], dim=1).tolist()
    assert abs(row["tau_top2_first"] - _tau(wider)) < 1e-3
    for domain in ("chat", "code"):
        mine = [h for h, d in zip(hit1.tolist(), domains, strict=True) if d == domain]
        if mine:
            assert abs(summary["domains"][domain]["tau"] - _tau(mine)) < 1e-3
    # Each bin's hit rate is over the positions whose target probability falls in it.
    for row, (low, high) in zip(
        summary["bins"], zip(tau_limits.BINS, tau_limits.BINS[1:], strict=False), strict=True
    ):
        inside = (top_p >= low) & (top_p < high)
        if inside.any():
            assert abs(row["hit_all"] - float(hit1[inside].float().mean())) < 1e-3
    assert "| all |" in tau_limits.markdown(summary)
