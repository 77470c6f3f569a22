"""Captured draft blocks: the drafter's block pass and greedy Markov decode replayed from a CUDA graph.

Eagerly, a block is a few hundred small kernel launches (the block pass, then per position the Markov
and confidence heads, the vocabulary projection and an argmax), so drafting is bound by the host. One
graph per power-of-two request count replays all of it; padding requests are empty windows whose
tokens store nothing (see `StaticLayout`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.attention_batch import AttentionBatch
from dspark.cuda_graphs import Captured, StaticLayout, next_pow2, pow2_upto

# (block ids [R * gamma], positions [R * gamma], layout) -> (drafts [R, gamma], confidences [R, gamma],
# drafted lengths [R]), device work only.
GreedyBlockFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


class DraftGraphs:
    """The captured greedy blocks of one proposer and the static inputs they read."""

    def __init__(
        self,
        block_fn: GreedyBlockFn,
        layout: StaticLayout,
        gamma: int,
        device: torch.device,
        emulate: bool = False,
    ) -> None:
        """emulate: no CUDA graphs, each replay runs `block_fn` eagerly from the static inputs."""
        self.block_fn = block_fn
        self.layout = layout
        self.gamma = gamma
        self.device = device
        self.emulate = emulate
        self.max_requests = layout.kv_lens.shape[0]
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.captured: dict[int, Captured] = {}

    def run(
        self, block_ids: torch.Tensor, pages: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Replay (capturing first if needed) the greedy block of these requests: drafts, confidences,
        lengths, views of the graph's outputs (read them before the next replay). None when the
        requests do not fit a captured size."""
        count = len(starts)
        requests = next_pow2(count)
        if requests > self.max_requests or not self.layout.holds(pages):
            return None
        self.layout.fill(block_ids, pages, starts, [self.gamma] * count, requests)
        captured = self.captured.get(requests)
        if captured is None:
            captured = self.captured[requests] = self._capture(requests)
        drafts, confidences, drafted = captured.replay()
        assert drafts is not None and confidences is not None and drafted is not None
        return drafts[:count], confidences[:count], drafted[:count]

    def capture_all(self) -> None:
        """Capture every request tier now (at start-up), each over an all-padding layout."""
        for requests in pow2_upto(self.max_requests):
            if requests not in self.captured:
                self.layout.fill(torch.zeros(0, dtype=torch.long), [], [], [], requests)
                self.captured[requests] = self._capture(requests)

    def _capture(self, requests: int) -> Captured:
        layout, tokens = self.layout, requests * self.gamma
        batch = layout.batch(tokens, requests, causal=False)
        block_ids, positions = layout.token_ids[:tokens], layout.positions[:tokens]

        def block() -> tuple[torch.Tensor | None, ...]:
            layout.compute(tokens, requests)
            return self.block_fn(block_ids, positions, batch)

        return Captured.capture(block, self.device, self.pool, self.emulate)
