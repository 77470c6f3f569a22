"""Captured target steps: a step of up to `max_tokens` tokens replays a CUDA graph of the forward.

A Python-driven forward launches hundreds of kernels per step, so a decode or verify step of a large
model is bound by the host, not by the GPU. One graph is captured per (token tier, request tier), the
powers of two a step is padded up to: padding tokens store nothing (slot -1) and padding windows are
empty with no keys (AttentionBatch.build). A replay copies the step's layout into the static buffers
the graph reads; logits are computed after it, for the rows the driver asks for only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.attention_batch import AttentionBatch
from dspark.kv_cache import PagedKVCache
from dspark.models.llama import CausalLM


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def step_tiers(
    num_tokens: int, num_requests: int, max_tokens: int, max_requests: int
) -> tuple[int, int] | None:
    """The padded (tokens, requests) a step of this size runs at, or None when it is too large to capture
    (max_tokens, max_requests: powers of two, max_requests <= max_tokens)."""
    if num_tokens < 1 or num_tokens > max_tokens or num_requests > max_requests:
        return None
    tokens = next_pow2(num_tokens)
    return tokens, min(next_pow2(max(num_requests, 1)), tokens)


@dataclass
class CapturedForward:
    """One captured forward and its static outputs (views into the graph's memory). Emulated (no
    graph): `forward` runs eagerly from the same static inputs at each replay."""

    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor
    features: torch.Tensor | None
    forward: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def replay(self) -> None:
        """Run the step: the graph, or (emulated) the forward into the same output tensors."""
        if self.graph is not None:
            self.graph.replay()
            return
        assert self.forward is not None
        hidden, features = self.forward()
        self.hidden.copy_(hidden)
        if self.features is not None and features is not None:
            self.features.copy_(features)


@dataclass
class GraphStepOutput:
    """A replayed step on the device: final normed hidden [num_tokens, hidden] (a view of the graph's
    output: read it before the next replay), captured features (or None) and each token's cache slot
    (copies, safe to keep)."""

    hidden: torch.Tensor
    features: torch.Tensor | None
    slots: torch.Tensor


class CudaGraphs:
    """The captured forwards of one target shard and the static inputs they read."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        device: torch.device,
        max_tokens: int,
        max_requests: int,
        emulate: bool = False,
    ) -> None:
        """emulate: no CUDA graphs, each replay runs the forward eagerly from the static buffers (so the
        buffer and padding logic is tested on any device)."""
        self.model = model
        self.emulate = emulate
        self.cache = cache
        self.device = device
        self.max_tokens = next_pow2(max_tokens)
        self.max_requests = min(next_pow2(max_requests), self.max_tokens)
        cfg = model.config
        # A request never holds more pages than its longest context needs, nor more than the cache has.
        self.max_pages = min(-(-cfg.max_position_embeddings // cache.page_size) + 1, cache.num_pages)
        self.token_ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_tokens,), -1, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(self.max_requests + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(self.max_requests, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(self.max_requests, self.max_pages, dtype=torch.int32, device=device)
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.captured: dict[tuple[int, int, tuple[int, ...]], CapturedForward] = {}

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        pages: list[list[int]],
        window_starts: list[int],
        window_lens: list[int],
        capture_layers: tuple[int, ...],
    ) -> GraphStepOutput | None:
        """Replay (capturing first if needed) the forward of this step; None when it does not fit."""
        tiers = step_tiers(len(token_ids), len(window_lens), self.max_tokens, self.max_requests)
        if tiers is None or max((len(p) for p in pages), default=0) > self.max_pages:
            return None
        tokens, requests = tiers
        layout = AttentionBatch.build(
            pages,
            window_starts,
            window_lens,
            self.cache.page_size,
            True,
            torch.device("cpu"),
            tokens,
            requests,
        )
        n = len(token_ids)
        self.token_ids[:n].copy_(token_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:tokens].copy_(layout.slots, non_blocking=True)
        self.cu_seqlens[: requests + 1].copy_(layout.cu_seqlens_q, non_blocking=True)
        self.kv_lens[:requests].copy_(layout.kv_lens, non_blocking=True)
        width = layout.page_table.shape[1]
        self.page_table[:requests, :width].copy_(layout.page_table, non_blocking=True)
        key = (tokens, requests, tuple(capture_layers))
        captured = self.captured.get(key)
        if captured is None:
            captured = self.captured[key] = self._capture(tokens, requests, tuple(capture_layers))
        captured.replay()
        features = None if captured.features is None else captured.features[:n].clone()
        return GraphStepOutput(captured.hidden[:n], features, self.slots[:n].clone())

    def _capture(self, tokens: int, requests: int, capture_layers: tuple[int, ...]) -> CapturedForward:
        batch = AttentionBatch(
            self.cu_seqlens[: requests + 1],
            self.kv_lens[:requests],
            self.page_table[:requests],
            self.slots[:tokens],
            causal=True,
        )

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.model(
                self.token_ids[:tokens], self.positions[:tokens], batch, self.cache, capture_layers
            )

        if self.emulate:
            hidden, features = forward()
            return CapturedForward(None, hidden, features, forward)
        # Compile and autotune every kernel outside the capture, on a side stream as capture wants. The
        # static inputs already hold this step, so the warm-up writes the very keys the replay will.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, features = forward()
        return CapturedForward(graph, hidden, features)
