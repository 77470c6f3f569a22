"""What a drafter costs per decoding step: the KV injection of a step's verified window plus one greedy
block (block pass, Markov decode, confidences), timed through the engine's own proposer.

On a GPU the block replays from the proposer's CUDA graph, as the engine drafts; the injection, which
the engine runs inside the target step's graph, runs eagerly here, so the figure is an upper bound on
what drafting adds to a step. Context keys and values are random: the cost does not depend on them.
"""

from __future__ import annotations

import statistics
import time

import torch

from dspark.sampling_params import SamplingParams
from dspark.sequence import Sequence
from dspark.spec.drafter import Drafter
from dspark.spec.proposer import DSparkProposer

PAGE_SIZE = 16


def drafter_step_seconds(
    drafter: Drafter,
    embedding: torch.Tensor,
    lm_head: torch.Tensor,
    batch: int,
    context: int,
    repeats: int,
    use_graphs: bool,
) -> float:
    """Median seconds of one decoding step's drafter work for `batch` greedy requests, each after
    `context` cached positions. embedding, lm_head: the target's [vocab, hidden] weights."""
    cfg = drafter.config
    device = drafter.fc.weight.device
    window = cfg.block_size + 1
    pages_per_request = -(-(context + window) // PAGE_SIZE)
    proposer = DSparkProposer(drafter, embedding, lm_head, batch * pages_per_request, PAGE_SIZE)
    if use_graphs:
        proposer.use_graphs(batch, pages_per_request)
    pages = [list(range(r * pages_per_request, (r + 1) * pages_per_request)) for r in range(batch)]
    generator = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(
            request_id=str(r),
            arrival=r,
            prompt_token_ids=torch.randint(0, cfg.vocab_size, (context + 1,), generator=generator).tolist(),
            params=SamplingParams(temperature=0.0),
            generator=None,
            num_cached=context,
            pages=pages[r],
        )
        for r in range(batch)
    ]
    features_dim = len(cfg.target_layer_ids) * cfg.hidden_size

    def injection(first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features, positions and slots of positions first..first+count-1 of every request."""
        positions = torch.arange(first, first + count).repeat(batch)
        page_of = torch.tensor(pages)[torch.arange(batch).repeat_interleave(count), positions // PAGE_SIZE]
        slots = page_of * PAGE_SIZE + positions % PAGE_SIZE
        features = torch.randn(batch * count, features_dim, generator=generator)
        dtype = drafter.fc.weight.dtype
        return features.to(device, dtype), positions.to(device), slots.to(device)

    with torch.inference_mode():
        proposer.inject(*injection(0, context))
        step_inputs = injection(context, window)

        def step() -> None:
            proposer.inject(*step_inputs)
            proposer.propose(seqs)

        step()  # warm-up (captures the block's graph)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            step()
            _synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
