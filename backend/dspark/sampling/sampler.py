"""Turning logits into tokens: temperature / top-k / top-p filtering and seeded per-request sampling.

A row whose distribution is not finite (NaN or inf anywhere: broken logits) yields NON_FINITE_TOKEN
instead of a token, and the engine fails that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.kernels import ops
from dspark.runner.host_to_device import to_device
from dspark.sampling_params import SamplingParams

NON_FINITE_TOKEN = -1  # in place of a token drawn from a distribution that is not finite


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one request: softmax(logits / T) restricted to top-k and top-p.

    logits: [num_rows, vocab] (every row uses the same request's params). Returns fp32 [num_rows, vocab].
    The same function shapes target and draft distributions, which keeps rejection sampling exact.
    """
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
        # The most likely token always stays (a top_p below its probability, even one that rounds to 0
        # in fp32, samples top-1).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def filtered_probs_of_requests(
    logits: Sequence[torch.Tensor], params: Sequence[SamplingParams]
) -> torch.Tensor:
    """`filtered_probs` of every request's rows (logits[i]: [rows_i, vocab], params[i]), concatenated in
    order: fp32 [sum of rows, vocab]. Requests with the same temperature, top-k and top-p share one
    call, whose every row is what the request's own call gives (each row is filtered on its own)."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    if len(groups) == 1:
        return filtered_probs(torch.cat(list(logits)), params[0])
    sizes = [rows.shape[0] for rows in logits]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    out = torch.empty(starts[-1], logits[0].shape[-1], dtype=torch.float32, device=logits[0].device)
    for members in groups.values():
        rows = [r for i in members for r in range(starts[i], starts[i] + sizes[i])]
        out[to_device(torch.tensor(rows), out.device)] = filtered_probs(
            torch.cat([logits[i] for i in members]), params[members[0]]
        )
    return out


def draw_uniforms_into(out: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill `out` (contiguous) with U(0, 1) draws from a request's generator: the numbers `draw_uniforms`
    gives, drawn in place when the generator lives on `out`'s device."""
    if generator is None or generator.device == out.device:
        out.uniform_(generator=generator)
    else:
        out.copy_(draw_uniforms(out.numel(), generator, out.device).view_as(out))


def draw_exponentials_into(out: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill `out` (contiguous) with Exp(1) draws from a request's generator: the numbers
    `draw_exponentials` gives, drawn in place when the generator lives on `out`'s device."""
    if generator is None or generator.device == out.device:
        out.exponential_(generator=generator)
    else:
        out.copy_(draw_exponentials(out.shape, generator, out.device))


def draw_uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """`count` uniforms in [0, 1) from a request's generator, drawn where the generator lives, on `device`."""
    where = generator.device if generator is not None else device
    return to_device(torch.rand(count, generator=generator, device=where), device)


def draw_exponentials(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Exp(1) draws of `shape` (fp32) from a request's generator, drawn where the generator lives, on
    `device`. The engine gives each request a generator on its own device, so a GPU draws them itself:
    a vocabulary's worth a token on the host took about a millisecond and then a copy."""
    where = generator.device if generator is not None else device
    drawn = torch.empty(shape, dtype=torch.float32, device=where).exponential_(generator=generator)
    return to_device(drawn, device)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [num_rows, vocab], drawn with the request's generator."""
    return ops.exponential_race_sample(probs, draw_exponentials(probs.shape, generator, probs.device))


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy argmax or a seeded sample for one request's rows: [num_rows, vocab] -> [num_rows]; a sampled
    row whose distribution is not finite gives NON_FINITE_TOKEN."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, params)
    tokens = sample_rows(probs, generator)
    return torch.where(torch.isfinite(probs.sum(-1)), tokens, NON_FINITE_TOKEN)
