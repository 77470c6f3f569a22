"""vLLM's penalties and min_tokens written out token by token: the reference the engine is held to."""

from __future__ import annotations

import torch

from dspark.sampling_params import SamplingParams


def penalized_row(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    stop_ids: list[int],
) -> torch.Tensor:
    """One position's logits [vocab] after vLLM's min_tokens, repetition, frequency and presence
    penalties, given the prompt and the output tokens before the position (a copy, fp32)."""
    row = logits.float().clone()
    if len(output) < params.min_tokens:
        for token in stop_ids:
            row[token] = float("-inf")
    seen_anywhere = set(prompt) | set(output)
    for token in range(row.shape[0]):
        count = output.count(token)
        value = float(row[token])
        if token in seen_anywhere:
            r = params.repetition_penalty
            value = value * (1.0 / r) if value > 0 else value * r
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (1 if count else 0)
        row[token] = value
    return row
