"""Acceptance: which verified drafts a request keeps, and the token that follows them."""

from __future__ import annotations

import torch

from dspark.sampling import filtered_probs, sample_rows, uniform
from dspark.sampling_params import SamplingParams


def rejection_accept(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless speculative sampling over one window.

    draft_tokens: the l verified drafts; draft_probs: [l, vocab] the drafter's filtered distributions
    they were sampled from; target_logits: [l + 1, vocab]. Draft i is kept with probability
    min(1, p_t(d_i) / p_d(d_i)); the first rejection resamples from normalize(max(0, p_t - p_d)); if
    all pass, the bonus is drawn from p_t at the last position. Returns (num_accepted, next_token).
    """
    target_probs = filtered_probs(target_logits, params)
    for i, token in enumerate(draft_tokens):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if uniform(generator) * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i].to(target_probs.dtype)).clamp_min(0.0)
        mass = residual.sum()
        # p == q everywhere leaves no residual; then rejection had probability zero, keep p_t.
        row = residual / mass if mass > 0 else target_probs[i]
        return i, int(sample_rows(row[None], generator)[0])
    last = len(draft_tokens)
    return last, int(sample_rows(target_probs[last : last + 1], generator)[0])
