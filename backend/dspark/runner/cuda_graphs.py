"""Captured target steps: a step of up to `max_tokens` tokens replays a CUDA graph of the forward.

A Python-driven forward launches hundreds of kernels per step, so a decode or verify step of a large
model is bound by the host, not by the GPU. One graph is captured per (token tier, request tier) a
step is padded up to (`token_tiers` or a configured set; requests: powers of two): padding tokens
store nothing (slot -1) and padding windows are empty with no keys. A replay copies the step's
tokens and windows (start, length, pages) into the static buffers the graph reads, and the graph
lays them out itself (the layout kernel, see `StaticLayout`); logits are computed after it, for the
rows the driver asks for only. A feature sink (the drafter's KV injection) is captured into the same
graph, so a speculative step injects for free.

Tensor-parallel ranks must replay the same graph for every step (the collectives inside carry the
padded tier's shapes), so a start-up capture is agreed over the group (`CudaGraphs.capture_all`):
the ranks capture the token tiers all of them can, in the same order, and if a capture fails on any
rank, every rank drops its graphs and runs eagerly. Every capture is logged and kept in `capture_log`.
"""

from __future__ import annotations

import gc
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from dspark.kernels import ops
from dspark.parallel.distributed import SINGLE, TensorParallel
from dspark.runner.attention_batch import AttentionBatch, page_table_width, write_page_rows
from dspark.runner.deferred_inputs import DeferredInputs
from dspark.runner.host_to_device import copy_to_device
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.llama import CausalLM

if TYPE_CHECKING:
    from dspark.config import EngineConfig

logger = logging.getLogger(__name__)

# Takes (features [T, L * hidden], positions [T], slots [T]) of every token of a step (padding: slot -1).
FeatureSink = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


Outputs = TypeVar("Outputs")


def capture_graph(
    fn: Callable[[], Outputs], device: torch.device, pool: tuple[int, int] | None
) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """Capture `fn` (which reads and writes static tensors only) as a CUDA graph; return it and the
    outputs of the captured call, which every replay rewrites in place."""
    # Compile and autotune every kernel outside the capture, on a side stream as capture wants. The
    # static inputs already hold the call's real inputs, so the warm-up writes what a replay would.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture (torch.cuda.graph collects just before it): a collection
    # there can free a dropped engine's graphs, and a graph destroyed while a capture runs invalidates
    # that capture (cudaErrorStreamCaptureInvalidated), which leaves the CUDA generator in capture mode
    # and every later random op of the process failing ("Offset increment outside graph capture").
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs


def new_pool(emulate: bool) -> tuple[int, int] | None:
    """A fresh private memory pool for a set of graphs to share (None when emulated).

    Graphs dropped together must take their pool with them: once every graph of a pool is freed the
    pool is dead, and PyTorch asserts (`use_count > 0`) on a capture into it while any block of it is
    still allocated: an output view someone holds, or the cuBLAS workspace (32 MiB on an H200) that
    the process's first captured matmul allocates for the capture stream, which cuBLAS keeps. A
    capture that fails there leaves the default CUDA generator in capture mode, so every later random
    op fails too ("Offset increment outside graph capture")."""
    return None if emulate else torch.cuda.graph_pool_handle()


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(n - 1, 0).bit_length()


# Token tiers: ascending token counts, or an int, the default ladder up to it (`token_tiers`).
Tiers = int | Sequence[int]


def ladder(tiers: Tiers) -> Sequence[int]:
    """The token tiers `tiers` stands for: itself, or `token_tiers` of an int (a power of two)."""
    return token_tiers(tiers) if isinstance(tiers, int) else tiers


def step_tiers(num_tokens: int, num_requests: int, tiers: Tiers, max_requests: int) -> tuple[int, int] | None:
    """The padded (tokens, requests) a step of this size runs at, or None when it is too large to capture
    (tiers: see `Tiers`; max_requests: a power of two). The token tier is the smallest that holds the
    step's tokens and, since a tier holds at least one token per window, its request tier."""
    if num_tokens < 1 or num_requests > max_requests:
        return None
    requests = next_pow2(max(num_requests, 1))
    tokens = ladder(tiers)
    i = bisect_left(tokens, max(num_tokens, requests))
    return (tokens[i], requests) if i < len(tokens) else None


def token_tiers(max_tokens: int) -> list[int]:
    """The token counts steps are padded up to: powers of two to FINE_TIERS_FROM, then quarter steps
    between powers of two (160, 192, 224, 256, 320, ...) up to `max_tokens` (a power of two).

    Why quarters: a busy speculative batch sits right at a power of two (64 requests verifying 4
    tokens each are 256), so the prompt chunk of one new arrival would pad it to 512 and make every
    such step pay for twice the tokens; a quarter step bounds the padding at 25%."""
    tiers = []
    for power in pow2_upto(max_tokens):
        if power > FINE_TIERS_FROM:
            quarter = power // 8  # a quarter of the gap from power / 2 to power
            tiers.extend(power // 2 + quarter * k for k in (1, 2, 3))
        tiers.append(power)
    return tiers


# Below this many tokens a step is padded to the next power of two (the graphs are few and cheap).
FINE_TIERS_FROM = 128


def all_tiers(tiers: Tiers, max_requests: int) -> list[tuple[int, int]]:
    """Every (tokens, requests) tier `step_tiers` can return, in capture order: the graphs a start-up
    capture makes."""
    return [
        (tokens, requests)
        for tokens in ladder(tiers)
        for requests in pow2_upto(min(next_pow2(tokens), max_requests))
        if requests <= tokens
    ]


def pow2_upto(limit: int) -> list[int]:
    """1, 2, 4, ..., up to `limit`."""
    return [1 << i for i in range(limit.bit_length())]


class StaticLayout:
    """The static inputs of captured steps, sized for the largest tier: token ids and each window's
    (start, length, pages). `fill` copies one step in (a few small host-to-device copies); `compute`,
    the first thing a captured call runs, lays the tier out on the device from them
    (`ops.build_window_layout`: positions, slots, boundaries, key counts), so padding tokens store
    nothing (slot -1) and padding windows are empty. `batch` is a tier's AttentionBatch, views that
    `compute` rewrites."""

    def __init__(
        self,
        max_tokens: int,
        max_requests: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        page_table: torch.Tensor | None = None,
    ) -> None:
        """page_table: another layout's [>= max_requests, max_pages] table to read instead of an own
        one (a draft block laid out over the target step's windows)."""
        self.page_size = page_size
        self.max_pages = max_pages
        # One buffer that `fill` copies in at once (each copy from the host is a pinned staging and a
        # queued copy, tens of microseconds of the step's host time): the token ids; each window's
        # start, length and verify flag (1: a verify window, whose drafts the step packs in); the
        # deferred inputs' index (`DeferredInputs.index`, at most a row per window); then the step's
        # page table rows, int32, which the device copies on into `page_table`. Only the part a step
        # uses is copied.
        # Where each part sits, for the device buffer and `fill`'s host one alike.
        self._bounds_at = slice(max_tokens, max_tokens + 3 * max_requests)
        self._index_at = slice(self._bounds_at.stop, self._bounds_at.stop + 3 * max_requests)
        self._header = self._index_at.stop
        table_longs = -(-(max_requests * max_pages) // 2)
        self._inputs = torch.zeros(self._header + table_longs, dtype=torch.long, device=device)
        self.token_ids = self._inputs[:max_tokens]
        self._bounds = self._inputs[self._bounds_at].view(3, max_requests)
        self.window_starts, self.window_lens, self.verify_flags = self._bounds
        self._deferred_index = self._inputs[self._index_at].view(3, max_requests)
        self._table_rows = self._inputs[self._header :].view(torch.int32)
        if page_table is None:
            page_table = torch.zeros(max_requests, max_pages, dtype=torch.int32, device=device)
        self.page_table = page_table
        # Written by `compute`.
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)

    def holds(self, pages: list[list[int]]) -> bool:
        """Whether every window's page list fits the static page table."""
        return max(map(len, pages), default=0) <= self.max_pages

    def fill(
        self,
        token_ids: torch.Tensor,
        pages: list[list[int]],
        window_starts: list[int],
        window_lens: list[int],
        num_verify: int = 0,
        deferred: DeferredInputs | None = None,
    ) -> None:
        """Copy a step (host tensors and lists) in, in one copy from the host: the token ids, the
        windows (every window past its own is empty, so that any tier reads padding there) and the
        page table rows. The first `num_verify` windows are flagged as verify windows. `deferred`:
        what the windows take from an earlier step not yet accepted, applied on the device after the
        copy."""
        count = len(window_lens)
        width = page_table_width(pages)
        used = self._header + (-(-(count * width) // 2) if count else 0)
        host = np.zeros(used, dtype=np.int64)
        host[: len(token_ids)] = token_ids.numpy()
        bounds = host[self._bounds_at].reshape(self._bounds.shape)
        bounds[0, :count] = window_starts
        bounds[1, :count] = window_lens
        bounds[2, :num_verify] = 1
        following = 0 if deferred is None else deferred.index.shape[1]
        if following:
            host[self._index_at].reshape(self._deferred_index.shape)[:, :following] = deferred.index.numpy()
        if count:
            write_page_rows(host[self._header :].view(np.int32)[: count * width].reshape(count, width), pages)
        copy_to_device(self._inputs[:used], torch.from_numpy(host))
        if deferred is not None:
            deferred.apply(self.token_ids, self.window_starts, self._deferred_index[:, :following])
        if count:
            # Columns past a step's widest row keep older pages: no key of a shorter row reaches them.
            rows = self._table_rows[: count * width].view(count, width)
            self.page_table[:count, :width].copy_(rows)

    def advance_decode(self, count: int, anchors: torch.Tensor) -> None:
        """Make the filled step of `count` one-token windows the next one, on the device: each window one
        position on, its token `anchors[i]` (the step's own output; pages for it reserved and in the
        table already). Two device ops, nothing from the host (a decode burst's later steps)."""
        self.window_starts[:count].add_(1)
        self.token_ids[:count].copy_(anchors[:count])

    def advance_verify(
        self, count: int, accepted: torch.Tensor | None, anchors: torch.Tensor, anchor_rows: torch.Tensor
    ) -> None:
        """Make the filled step of `count` verify windows the next one, on the device: each window on by
        the drafts it accepted and its anchor (`accepted` [count], None: none were), its anchor
        (row `anchor_rows[i]` of the token ids) `anchors[i]`; lengths, verify flags and the page table
        (pages reserved already) stay. The drafts after each anchor are made into the layout next."""
        starts = self.window_starts[:count]
        starts.add_(1)
        if accepted is not None:
            starts.add_(accepted[:count])
        self.token_ids.index_copy_(0, anchor_rows, anchors[:count])

    def compute(self, tokens: int, requests: int) -> None:
        """Lay out a (tokens, requests) tier from the filled windows, on the device."""
        ops.build_window_layout(
            self.window_starts[:requests],
            self.window_lens[:requests],
            self.page_table[:requests],
            self.page_size,
            tokens,
            out=(
                self.positions[:tokens],
                self.slots[:tokens],
                self.cu_seqlens[: requests + 1],
                self.kv_lens[:requests],
            ),
        )

    def batch(self, tokens: int, requests: int, causal: bool) -> AttentionBatch:
        """The static AttentionBatch of a (tokens, requests) tier."""
        return AttentionBatch(
            self.cu_seqlens[: requests + 1],
            self.kv_lens[:requests],
            self.page_table[:requests],
            self.slots[:tokens],
            causal,
        )


@dataclass
class Captured:
    """One captured call and its static outputs (graph memory). Emulated (graph None): `fn` runs
    eagerly from the same static inputs at each replay and its results are copied into `outputs`."""

    graph: torch.cuda.CUDAGraph | None
    outputs: tuple[torch.Tensor | None, ...]
    fn: Callable[[], tuple[torch.Tensor | None, ...]]

    @classmethod
    def capture(
        cls,
        fn: Callable[[], tuple[torch.Tensor | None, ...]],
        device: torch.device,
        pool: tuple[int, int] | None,
        emulate: bool,
    ) -> Captured:
        """Capture `fn` (emulated: call it once for the outputs' shapes)."""
        if emulate:
            return cls(None, fn(), fn)
        graph, outputs = capture_graph(fn, device, pool)
        return cls(graph, outputs, fn)

    def replay(self) -> tuple[torch.Tensor | None, ...]:
        """Run the call; returns the static outputs."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        for static, fresh in zip(self.outputs, self.fn(), strict=True):
            if static is not None and fresh is not None:
                static.copy_(fresh)
        return self.outputs


def max_pages_per_request(max_positions: int, page_size: int, num_pages: int) -> int:
    """Page-table width of a captured step: the pages of the longest context, at most the whole cache."""
    return min(-(-max_positions // page_size) + 1, num_pages)


@dataclass
class GraphStepOutput:
    """A replayed step on the device: final normed hidden [num_tokens, hidden], captured features (or
    None) and each token's cache slot, views of the graph's buffers (read them before the next
    replay)."""

    hidden: torch.Tensor
    features: torch.Tensor | None
    slots: torch.Tensor


@dataclass(frozen=True)
class CaptureRecord:
    """One graph capture: its tier, how long it took (device synchronised before and after) and whether
    it succeeded (error: what it raised)."""

    tokens: int
    requests: int
    seconds: float
    ok: bool
    error: str = ""


@dataclass
class CaptureOutcome:
    """What a start-up capture agreed and did: the same on every tensor-parallel rank."""

    # The token tiers configured, and those every rank could capture (`capture_budget`, intersected).
    planned: list[int]
    tiers: list[int]
    # The token tiers each rank could capture, by rank.
    budgets: list[list[int]] = field(default_factory=list)
    # The first rank whose capture failed and at which (tokens, requests); None: every capture succeeded.
    failed_rank: int | None = None
    failed_at: tuple[int, int] | None = None

    @property
    def replays(self) -> bool:
        """Whether steps replay graphs after this capture: some tier agreed, and no rank failed."""
        return bool(self.tiers) and self.failed_rank is None


# Graph memory a capture leaves to others: the cuBLAS workspace the first captured matmul takes for the
# capture stream (32 MiB on an H200), NCCL's buffers, the allocator's rounding.
CAPTURE_RESERVE_BYTES = 256 << 20
# How far the per-token estimate of `capture_bytes` may be off (attention workspaces, allocator blocks).
CAPTURE_SAFETY = 2


def capture_bytes(graphs: CudaGraphs, plan: list[tuple[int, int]], capture_layers: tuple[int, ...]) -> int:
    """Estimated graph-pool memory of capturing `plan` (ascending tiers): every graph keeps its outputs
    (hidden, captured features), while the activations of one forward, the largest, are shared."""
    cfg, tp = graphs.model.config, graphs.model.tp
    outputs = cfg.hidden_size * (1 + len(capture_layers))
    q_kv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp.size
    # Residual, norm, attention output and MLP output; Q, K and V; gate, up and their product.
    activations = 4 * cfg.hidden_size + q_kv + 3 * cfg.intermediate_size // tp.size
    element = graphs.cache.k.element_size()
    largest = max((tokens for tokens, _ in plan), default=0)
    return element * (sum(tokens for tokens, _ in plan) * outputs + largest * activations)


def capture_budget(graphs: CudaGraphs, capture_layers: tuple[int, ...]) -> list[int]:
    """The token tiers this rank can capture: the smallest first, while the estimated graph memory of
    them all (`capture_bytes`, with CAPTURE_SAFETY and CAPTURE_RESERVE_BYTES) fits the device's free
    memory; every tier when emulated. Ranks differ (rank 0 also holds the drafter), hence the
    agreement in `CudaGraphs.capture_all`."""
    tiers = list(graphs.token_tiers)
    if graphs.emulate or graphs.device.type != "cuda":
        return tiers
    free, _ = torch.cuda.mem_get_info(graphs.device)
    # Blocks PyTorch caches but nobody uses are freed for a capture that needs them.
    free += torch.cuda.memory_reserved(graphs.device) - torch.cuda.memory_allocated(graphs.device)
    fits = 0
    while fits < len(tiers):
        plan = all_tiers(tiers[: fits + 1], graphs.max_requests)
        if CAPTURE_SAFETY * capture_bytes(graphs, plan, capture_layers) + CAPTURE_RESERVE_BYTES > free:
            break
        fits += 1
    return tiers[:fits]


class CudaGraphs:
    """The captured forwards of one target shard and the static inputs they read."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        device: torch.device,
        tiers: Tiers,
        max_requests: int,
        emulate: bool = False,
    ) -> None:
        """tiers: the token tiers steps are padded up to, ascending, or an int: the default ladder up to
        its power of two. emulate: no CUDA graphs, each replay runs the forward eagerly from the static
        buffers (so the buffer, padding and agreement logic is tested on any device)."""
        self.model = model
        self.emulate = emulate
        self.cache = cache
        self.device = device
        self.token_tiers = list(ladder(next_pow2(tiers) if isinstance(tiers, int) else tiers))
        self.max_tokens = self.token_tiers[-1]
        # A request tier needs a token tier at least as large (one token per window).
        self.max_requests = min(next_pow2(max_requests), 1 << (self.max_tokens.bit_length() - 1))
        max_pages = max_pages_per_request(
            model.config.max_position_embeddings, cache.page_size, cache.num_pages
        )
        self.layout = StaticLayout(self.max_tokens, self.max_requests, max_pages, cache.page_size, device)
        self.pool = new_pool(emulate)
        self.captured: dict[tuple[int, int, tuple[int, ...]], Captured] = {}
        self.feature_sink: FeatureSink | None = None
        # Every capture this object made, in order (start-up and on first use).
        self.capture_log: list[CaptureRecord] = []

    @classmethod
    def from_config(
        cls,
        model: CausalLM,
        cache: PagedKVCache,
        device: torch.device,
        config: EngineConfig,
        emulate: bool = False,
    ) -> CudaGraphs:
        """The graphs `config` asks for (cuda_graph_token_tiers, else the ladder up to
        cuda_graph_max_tokens; both at most max_num_batched_tokens), up to max_num_seqs requests."""
        tiers = config.cuda_graph_tiers or min(config.cuda_graph_max_tokens, config.max_num_batched_tokens)
        return cls(model, cache, device, tiers, config.max_num_seqs, emulate)

    def set_feature_sink(self, sink: FeatureSink | None) -> None:
        """Capture `sink` after the forward of every step that captures features (graphs captured
        before are dropped: they do not call it)."""
        self.feature_sink = sink
        self._drop_captured()

    def release(self) -> None:
        """Free every captured graph (the next step captures its tier again)."""
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        self._drop_captured()

    def _drop_captured(self) -> None:
        """Free every captured graph; later captures share a new pool (see `new_pool`)."""
        self.captured.clear()
        self.pool = new_pool(self.emulate)

    def run(
        self,
        token_ids: torch.Tensor,
        pages: list[list[int]],
        window_starts: list[int],
        window_lens: list[int],
        capture_layers: tuple[int, ...],
    ) -> GraphStepOutput | None:
        """Replay (capturing first if needed) the forward of this step; None when it does not fit."""
        tiers = self.fill(token_ids, pages, window_starts, window_lens)
        return None if tiers is None else self.replay(tiers, len(token_ids), capture_layers)

    def fill(
        self,
        token_ids: torch.Tensor,
        pages: list[list[int]],
        window_starts: list[int],
        window_lens: list[int],
        num_verify: int = 0,
        deferred: DeferredInputs | None = None,
    ) -> tuple[int, int] | None:
        """Copy a step into the static inputs (`StaticLayout.fill`: the first `num_verify` windows are
        flagged as verify windows) and return the (tokens, requests) tier it replays at; None, with
        nothing copied, when it does not fit. Whatever else the step writes into the static token ids
        (its verify windows' drafts) goes there between this and `replay`."""
        tiers = self.tiers_of(len(token_ids), pages)
        if tiers is None:
            return None
        self.layout.fill(token_ids, pages, window_starts, window_lens, num_verify, deferred)
        return tiers

    def tiers_of(self, num_tokens: int, pages: list[list[int]]) -> tuple[int, int] | None:
        """The (tokens, requests) tier a step of `num_tokens` tokens over these windows' pages replays
        at; None when none holds it."""
        tiers = step_tiers(num_tokens, len(pages), self.token_tiers, self.max_requests)
        return tiers if tiers is not None and self.layout.holds(pages) else None

    def replay(
        self, tiers: tuple[int, int], num_tokens: int, capture_layers: tuple[int, ...]
    ) -> GraphStepOutput:
        """Replay (capturing first if needed) the forward of the filled step of `num_tokens` tokens at
        `tiers` (what `fill` returned)."""
        tokens, requests = tiers
        captured = self.captured.get((tokens, requests, tuple(capture_layers)))
        if captured is None:
            captured = self.capture(tokens, requests, tuple(capture_layers))
        hidden, features = captured.replay()
        assert hidden is not None
        n = num_tokens
        features = None if features is None else features[:n]
        return GraphStepOutput(hidden[:n], features, self.layout.slots[:n])

    def capture_all(self, capture_layers: tuple[int, ...], tp: TensorParallel = SINGLE) -> CaptureOutcome:
        """Capture every tier now (at start-up) rather than on a step's first use, which would stall it.
        Each is captured over an all-padding layout: no window, nothing stored.

        Every rank of `tp` calls this at once. The ranks first agree on the token tiers all of them can
        capture (`capture_budget`), and steps pad to those only; then they capture them in the same
        order, telling each other after each tier whether it succeeded, so that a failure on any rank
        makes every rank drop its graphs (and run eagerly) before any starts the next tier, whose
        warm-up would wait in a collective for the failed one. A rank that fails inside a warm-up's
        forward leaves the others in a collective: that ends the group (the tensor-parallel timeout)."""
        layers = tuple(capture_layers)
        mine = set(capture_budget(self, layers))
        can = _gather(tp, [int(t in mine) for t in self.token_tiers], self.device)
        agreed = [t for i, t in enumerate(self.token_tiers) if all(row[i] for row in can)]
        budgets = [[t for t, ok in zip(self.token_tiers, row, strict=True) if ok] for row in can]
        outcome = CaptureOutcome(list(self.token_tiers), agreed, budgets)
        self.token_tiers = agreed
        for tokens, requests in all_tiers(agreed, self.max_requests):
            failed = 0
            if (tokens, requests, layers) not in self.captured:
                self.layout.fill(torch.zeros(0, dtype=torch.long), [], [], [])
                try:
                    self.capture(tokens, requests, layers)
                except Exception:  # logged by `capture`; every rank learns of it just below
                    failed = 1
            ranks = [rank for rank, row in enumerate(_gather(tp, [failed], self.device)) if row[0]]
            if ranks:
                self._drop_captured()
                outcome.failed_rank, outcome.failed_at = ranks[0], (tokens, requests)
                break
        return outcome

    def capture(self, tokens: int, requests: int, capture_layers: tuple[int, ...]) -> Captured:
        """Capture one tier now, from a synchronised device (an earlier kernel's fault must not surface
        inside the capture), logged and recorded in `capture_log`; a failure is logged and re-raised."""
        start = time.perf_counter()
        try:
            self._synchronize()
            captured = self._capture(tokens, requests, capture_layers)
            self._synchronize()  # so a fault of this capture's warm-up is reported here, for this size
        except Exception as exc:
            seconds = time.perf_counter() - start
            self.capture_log.append(CaptureRecord(tokens, requests, seconds, False, str(exc)))
            logger.error("cuda graph capture failed at tokens=%d requests=%d: %s", tokens, requests, exc)
            raise
        seconds = time.perf_counter() - start
        self.capture_log.append(CaptureRecord(tokens, requests, seconds, True))
        logger.info("cuda graph captured: tokens=%d requests=%d in %.1f ms", tokens, requests, seconds * 1e3)
        self.captured[(tokens, requests, capture_layers)] = captured
        return captured

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture(self, tokens: int, requests: int, capture_layers: tuple[int, ...]) -> Captured:
        layout = self.layout
        batch = layout.batch(tokens, requests, causal=True)
        token_ids, positions, slots = (
            layout.token_ids[:tokens],
            layout.positions[:tokens],
            layout.slots[:tokens],
        )

        def forward() -> tuple[torch.Tensor | None, ...]:
            layout.compute(tokens, requests)
            hidden, features = self.model(token_ids, positions, batch, self.cache, capture_layers)
            if features is not None and self.feature_sink is not None:
                self.feature_sink(features, positions, slots)
            return hidden, features

        return Captured.capture(forward, self.device, self.pool, self.emulate)


def _gather(tp: TensorParallel, values: list[int], device: torch.device) -> list[list[int]]:
    """`values` of every rank, by rank (a collective: every rank calls it with as many values)."""
    mine = torch.tensor(values, dtype=torch.long, device=device)
    return tp.all_gather_last_dim(mine).view(tp.size, len(values)).tolist()
