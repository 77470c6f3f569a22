"""Captured draft blocks: the drafter's block pass and greedy Markov decode replayed from a CUDA graph.

Eagerly, a block is a few hundred small kernel launches (the block pass, then per position the Markov
and confidence heads, the vocabulary projection and an argmax), so drafting is bound by the host. One
graph per power-of-two request count replays all of it; padding requests are empty windows whose
tokens store nothing (see `StaticLayout`).

A block either takes its own inputs (`run`: block ids, starts and pages copied in) or, once it
follows a target step's layout (`follow`), reads them from that step's static buffers (`run_in_step`):
the anchors are the first tokens of the step's verify windows, the starts and pages theirs, and the
drafts are packed straight into the step's token ids. A static-length step then copies its windows to
the device once, and the host does nothing between the block and the target forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.kernels import ops
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.cuda_graphs import Captured, StaticLayout, new_pool, next_pow2, pow2_upto

# (block ids [R * block_size], positions [R * block_size], layout) -> (drafts [R, block_size],
# confidences [R, block_size], drafted lengths [R]), device work only.
GreedyBlockFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


class DraftGraphs:
    """The captured greedy blocks of one proposer and the static inputs they read."""

    def __init__(
        self,
        block_fn: GreedyBlockFn,
        layout: StaticLayout,
        block_size: int,
        device: torch.device,
        emulate: bool = False,
    ) -> None:
        """emulate: no CUDA graphs, each replay runs `block_fn` eagerly from the static inputs."""
        self.block_fn = block_fn
        self.layout = layout
        self.block_size = block_size
        self.device = device
        self.emulate = emulate
        self.max_requests = layout.kv_lens.shape[0]
        self.pool = new_pool(emulate)
        self.captured: dict[int, Captured] = {}
        # Set by `follow`: the target step layout blocks read, their own layout over its page table,
        # the mask token of the positions after the anchor, and the captured in-step blocks.
        self.target: StaticLayout | None = None
        self._in_step_layout: StaticLayout | None = None
        self._mask_token_id = 0
        self._verify_cu = torch.zeros(self.max_requests + 1, dtype=torch.int32, device=device)
        self.captured_in_step: dict[int, Captured] = {}

    def follow(self, target: StaticLayout, mask_token_id: int) -> None:
        """Let `run_in_step` read a target step's windows from `target` (the target graphs' layout);
        in-step blocks captured for another layout are dropped."""
        if target is self.target:
            return
        self.target = target
        self._mask_token_id = mask_token_id
        rows = min(self.max_requests, target.page_table.shape[0])
        self._in_step_layout = StaticLayout(
            rows * self.block_size,
            rows,
            target.max_pages,
            target.page_size,
            self.device,
            target.page_table[:rows],
        )
        self.captured_in_step.clear()
        # The dropped blocks may have been the last graphs of the pool (see `new_pool`).
        self.pool = new_pool(self.emulate)

    def run_in_step(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Replay the greedy block of the followed step's first `count` windows (its verify windows,
        flagged in its layout, which `fill` has written), packing the drafts into the step's token
        ids; drafts, confidences, lengths as `run` returns them. None when `count` requests do not fit."""
        layout = self._in_step_layout
        requests = next_pow2(count)
        if layout is None or requests > layout.kv_lens.shape[0]:
            return None
        return self._replay(self.captured_in_step, self._capture_in_step, requests, count)

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
        self.layout.fill(block_ids, pages, starts, [self.block_size] * count)
        return self._replay(self.captured, self._capture, requests, count)

    @staticmethod
    def _replay(
        captured: dict[int, Captured], capture: Callable[[int], Captured], requests: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the `requests` tier of `captured` (capturing it first if need be); the first `count`
        rows of its drafts, confidences and drafted lengths."""
        graph = captured.get(requests)
        if graph is None:
            graph = captured[requests] = capture(requests)
        drafts, confidences, drafted = graph.replay()
        assert drafts is not None and confidences is not None and drafted is not None
        return drafts[:count], confidences[:count], drafted[:count]

    def capture_all(self) -> None:
        """Capture every request tier now (at start-up), each over an all-padding layout, and the
        in-step blocks of a followed layout (whose windows are all padding until a step fills it)."""
        for requests in pow2_upto(self.max_requests):
            if requests not in self.captured:
                self.layout.fill(torch.zeros(0, dtype=torch.long), [], [], [])
                self.captured[requests] = self._capture(requests)
        if self._in_step_layout is not None:
            for requests in pow2_upto(self._in_step_layout.kv_lens.shape[0]):
                if requests not in self.captured_in_step:
                    self.captured_in_step[requests] = self._capture_in_step(requests)

    def _capture(self, requests: int) -> Captured:
        layout, tokens = self.layout, requests * self.block_size
        batch = layout.batch(tokens, requests, causal=False)
        block_ids, positions = layout.token_ids[:tokens], layout.positions[:tokens]

        def block() -> tuple[torch.Tensor | None, ...]:
            layout.compute(tokens, requests)
            return self.block_fn(block_ids, positions, batch)

        return Captured.capture(block, self.device, self.pool, self.emulate)

    def _capture_in_step(self, requests: int) -> Captured:
        target, layout, block_size = self.target, self._in_step_layout, self.block_size
        assert target is not None and layout is not None
        tokens = requests * block_size
        batch = layout.batch(tokens, requests, causal=False)
        block_ids, positions = layout.token_ids[:tokens], layout.positions[:tokens]
        # The verify windows' rows of the step's packed token ids (they come first).
        verify_rows = min(requests * (block_size + 1), target.token_ids.shape[0])
        cu = self._verify_cu[: requests + 1]

        def block() -> tuple[torch.Tensor | None, ...]:
            flags = target.verify_flags[:requests]
            # Verify windows' lengths (anchor included) and boundaries; 0 for any other window.
            cu[1:] = torch.cumsum(target.window_lens[:requests] * flags, 0)
            anchors = target.token_ids[cu[:-1].long().clamp(max=target.token_ids.shape[0] - 1)]
            layout.window_starts[:requests] = target.window_starts[:requests]
            layout.window_lens[:requests] = flags * block_size
            ids = block_ids.view(requests, block_size)
            ids[:, 0] = anchors
            ids[:, 1:] = self._mask_token_id
            layout.compute(tokens, requests)
            drafts, confidences, drafted = self.block_fn(block_ids, positions, batch)
            ops.pack_verify_tokens(
                anchors, drafts, cu, verify_rows, out=target.token_ids[:verify_rows], keep_past_end=True
            )
            return drafts, confidences, drafted

        return Captured.capture(block, self.device, self.pool, self.emulate)
