"""Proposers: what drafts a block for every decoding request. DSparkProposer runs the drafter."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark.kernels import ops
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.cuda_graphs import StaticLayout, next_pow2
from dspark.runner.host_to_device import to_device, to_host_queued
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.layers import pack_like_measured
from dspark.sampling.sampler import filtered_probs, sample_rows
from dspark.sequence import Sequence
from dspark.spec.draft_graphs import DraftGraphs
from dspark.spec.drafter import BlockHeads, Drafter
from dspark.spec.drafts import Drafts
from dspark.spec.lookup import LOOKUP_CONFIDENCE, PromptLookup

# Most feature rows `DSparkProposer.keep` holds before injecting them: a run of plain steps at 256
# requests injects every 16 steps, in one product of ~4k rows.
DEFERRED_ROWS = 4096


def latest_rows_only(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`slots` [rows] (-1: padding) with every row but the last to name a slot set to -1: one pass's
    writes to a slot have no order, and a slot two steps wrote (a request's, then another's that took
    its freed page) must hold the later row, as injecting step by step leaves it. No host sync (the
    rows written stay as many), so a flush never stalls the host running ahead of the device."""
    rows = torch.arange(slots.numel(), device=slots.device)
    index = torch.where(slots >= 0, slots, num_slots)
    latest = torch.full((num_slots + 1,), -1, dtype=torch.long, device=slots.device)
    latest.scatter_reduce_(0, index, rows, "amax")
    return torch.where(latest[index] == rows, slots, -1)


class Proposer(Protocol):
    """Drafts blocks and keeps whatever context it needs from the target's committed hidden states."""

    block_size: int
    target_layer_ids: list[int]

    def propose(self, seqs: Seq[Sequence], length: int | None = None) -> Drafts:
        """Draft one block per sequence (each has `num_cached` context positions and an anchor).
        length: no draft past this many is verified this step (a proposer may leave them out)."""
        ...

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Take the target features [num_tokens, L * hidden] of a step's tokens into the context.

        Every window row comes, rejected drafts' too, and padding rows with negative slots (skip them):
        a position's context is read only once the position is committed, and the step that commits
        it brings its true features. Called inside the target step's CUDA graph: device work only."""
        ...


class DSparkProposer:
    """Runs the DSpark drafter over paged draft KV (same page table as the target's)."""

    def __init__(
        self,
        drafter: Drafter,
        embedding: torch.Tensor,
        lm_head: torch.Tensor,
        num_pages: int,
        page_size: int,
        stop_survival: float = 0.0,
        block_size: int = 0,
        draft_vocab: torch.Tensor | None = None,
        lookup: PromptLookup | None = None,
    ) -> None:
        """block_size: positions a block drafts (0: the drafter's trained block size; fewer draft a
        shorter block, which costs less and changes which drafts come out, never the output).
        draft_vocab: the sorted token ids drafts may take (`spec.draft_vocab`; None: every token).
        lookup: where a request's last tokens occurred before, `propose` copies what followed them
        instead of drafting (`spec.lookup`; None: the drafter drafts every block)."""
        cfg = drafter.config
        if not 0 <= block_size <= cfg.block_size:
            raise ValueError(f"block_size: the drafter drafts at most {cfg.block_size}")
        device = drafter.fc.weight.device
        self.drafter = drafter
        # The target's full embedding and LM head [vocab, hidden]: shared, never copied.
        self.embedding = embedding
        self.lm_head = lm_head
        # A reduced draft vocabulary: the block's projections read only its rows of the LM head (and
        # of the Markov head's W2), copied once here; drafts are indices into it until mapped back.
        self.vocab_ids = None if draft_vocab is None else draft_vocab.to(device=device, dtype=torch.long)
        w1, w2 = drafter.markov_w1, drafter.markov_w2
        self.draft_head, self.draft_w1, self.draft_w2 = lm_head, None, None
        if self.vocab_ids is not None:
            self.draft_head = lm_head[self.vocab_ids].contiguous()
            if w1 is not None and w2 is not None:
                self.draft_w1 = w1.weight[self.vocab_ids].contiguous()
                self.draft_w2 = w2.weight[self.vocab_ids].contiguous()
        if device.type == "cpu":  # the products the target's measured paths take, over packed copies
            # Only the weights `linear` reads: the Markov and confidence heads' never go through it.
            pack_like_measured([drafter.fc.weight, *drafter.layers.parameters(), self.draft_head])
        self.block_size = block_size or cfg.block_size
        self.target_layer_ids = list(cfg.target_layer_ids)
        self.page_size = page_size
        self.cache = PagedKVCache(
            cfg.num_hidden_layers,
            num_pages,
            page_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            drafter.fc.weight.dtype,
            device,
        )
        self.device = device
        # An anchor feature's context rows, one per cache slot (and a last one padding tokens write):
        # each block reads the row of the position before it (`_anchor_rows`).
        self.context_rows = (
            torch.zeros(
                num_pages * page_size + 1, cfg.hidden_size, dtype=drafter.fc.weight.dtype, device=device
            )
            if cfg.anchor_feature
            else None
        )
        # A request stops drafting once the survival of its next draft falls below this (0: never).
        self.stop_survival = stop_survival
        self.lookup = lookup
        self._on_gpu = device.type == "cuda"
        # Captured greedy blocks (use_graphs); None: every block runs eagerly.
        self.graphs: DraftGraphs | None = None
        # Features `keep` holds for the next `flush`, oldest first, with their row count.
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._kept_rows = 0
        # Cache slots (and a last entry for padding's slot -1): where `flush` finds each slot's latest row.
        self._num_slots = num_pages * page_size

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """KV injection of the step's target features into every drafter layer (inside the step's graph
        when it replays one; whatever `keep` holds is flushed before, by whoever runs the step)."""
        if features.shape[0]:
            self.drafter.inject_context(features, positions, slots, self.cache, self.context_rows)

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Hold the step's features (copies: a step's tensors may be buffers the next one refills) until
        the next block is drafted (`flush`), DEFERRED_ROWS rows at most: a step that verifies no draft
        then costs no projection (on this project's CPU ~1 ms a step, 2% of a plain step at 8
        requests), and a run of them is projected once, its weights read once."""
        if not features.shape[0]:
            return
        self._kept.append((features.clone(), positions.clone(), slots.clone()))
        self._kept_rows += features.shape[0]
        if self._kept_rows >= DEFERRED_ROWS:
            self.flush()

    def flush(self) -> None:
        """Inject the features `keep` holds, all in one pass, as injecting them step by step would."""
        if not self._kept:
            return
        several = len(self._kept) > 1
        features, positions, slots = (torch.cat(parts) for parts in zip(*self._kept, strict=True))
        self._kept.clear()
        self._kept_rows = 0
        if several:
            slots = latest_rows_only(slots, self._num_slots)
        self.drafter.inject_context(features, positions, slots, self.cache, self.context_rows)

    def use_graphs(self, max_requests: int, max_pages: int, emulate: bool = False) -> None:
        """Replay greedy blocks of up to `max_requests` requests (each with at most `max_pages` pages)
        from CUDA graphs, one per power-of-two request count (emulate: eagerly from the static inputs)."""
        block_size = self.block_size
        requests = next_pow2(max_requests)
        self.graphs = DraftGraphs(
            self._greedy_block,
            StaticLayout(requests * block_size, requests, max_pages, self.page_size, self.device),
            block_size,
            self.device,
            emulate,
        )

    def follow_target_layout(self, layout: StaticLayout) -> bool:
        """Let greedy blocks draft inside a target step laid out in `layout` (the target graphs'):
        `propose_in_step`. False when this proposer replays no graphs."""
        if self.graphs is None:
            return False
        self.graphs.follow(layout, self.drafter.config.mask_token_id)
        return True

    @torch.inference_mode()
    def propose_in_step(self, seqs: Seq[Sequence]) -> Drafts | None:
        """Draft the followed target step's verify windows (the first len(seqs) windows of the step
        its layout holds, which must be these requests') from that layout, packing the drafts into
        its token ids on the device. None when it cannot (sampling requests, no followed layout, too
        many requests): draft with `propose` instead. The drafts are views of the graph's outputs,
        valid until the next in-step block."""
        if self.graphs is None or not all(s.params.greedy for s in seqs):
            return None
        self.flush()
        drafted = self.graphs.run_in_step(len(seqs))
        if drafted is None:
            return None
        tokens, confidences, lengths = drafted
        # Views of the graph's outputs, not copies: the step that drafted them accepts them before the
        # next in-step block is replayed. The drafted lengths only count the step's drafted tokens once
        # it is accepted, so they come to the host by a queued copy: `lengths.cpu()` here waited for
        # the device to finish the step in flight, in the middle of launching the next one.
        stopped = to_host_queued(lengths) if self.stop_survival > 0.0 else None
        return Drafts(tokens, confidences, [None] * len(seqs), stopped)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every draft graph now (start-up), so that no step stalls on a capture."""
        if self.graphs is not None:
            self.graphs.capture_all()

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], length: int | None = None, copies: bool = True) -> Drafts:
        """Copied drafts (`lookup`) for the requests whose last tokens occurred before; for the others
        (all, without a lookup or with `copies` false) a block pass, then left-to-right Markov decode
        with confidences. length: drafts past it are left out (zeros, not counted as drafted); on the
        CPU they are not decoded at all, which saves their vocabulary projections. copies: false where
        the verify windows were fixed before drafting (`InStepDrafts`): a copy may be shorter than its
        window, and a window position without a draft must not be verified."""
        length = self.block_size if length is None else min(length, self.block_size)
        self.flush()  # the context the block reads
        copied = None
        if copies and self.lookup is not None:
            count = self._copy_count(length)
            copied = [self.lookup.drafts(seq, count) for seq in seqs]
        if copied is None or not any(copied):
            return self._propose_drafted(seqs, length)
        drafted = [r for r, block in enumerate(copied) if not block]
        inner = self._propose_drafted([seqs[r] for r in drafted], length) if drafted else None
        return self._with_copies(seqs, copied, drafted, inner)

    def _copy_count(self, length: int) -> int:
        """Most drafts a copied block takes: `length`, fewer where the early stop would end it sooner."""
        count = length
        while count and self.stop_survival > 0.0 and LOOKUP_CONFIDENCE**count < self.stop_survival:
            count -= 1
        return count

    def _with_copies(
        self, seqs: Seq[Sequence], copied: list[list[int]], drafted: list[int], inner: Drafts | None
    ) -> Drafts:
        """One block per request: the copied drafts, and `inner`'s rows (the drafter's) for the requests
        `drafted` (those with no copy). Lengths always come (a copy may be shorter than the block)."""
        num_requests, block_size = len(seqs), self.block_size
        # One tensor each from Python lists (per-request slice writes cost ~10 us each: at 64-256
        # requests a step, most of the lookup's host time).
        tokens = torch.tensor([block + [0] * (block_size - len(block)) for block in copied], dtype=torch.long)
        lengths = torch.tensor([len(block) for block in copied], dtype=torch.long)
        confidences = torch.where(torch.arange(block_size) < lengths[:, None], LOOKUP_CONFIDENCE, 0.0).to(
            torch.float32
        )
        probs: list[torch.Tensor | None] = [None] * num_requests
        vocab = self.lm_head.shape[0]
        for r, block in enumerate(copied):
            n = len(block)
            if n and not seqs[r].params.greedy:  # a certain choice: one-hot, on the device acceptance reads
                one_hot = torch.zeros(block_size, vocab, device=self.device)
                one_hot[torch.arange(n, device=self.device), torch.tensor(block, device=self.device)] = 1.0
                probs[r] = one_hot
        # Greedy blocks' tokens stay on the device (as the drafter's); sampling ones come to the host.
        on_device = all(seq.params.greedy for seq in seqs)
        tokens = to_device(tokens, self.device) if on_device else tokens
        confidences = to_device(confidences, self.device)
        if inner is not None:
            rows = torch.tensor(drafted)
            tokens[rows.to(tokens.device)] = inner.tokens.to(tokens.device)
            confidences[rows.to(self.device)] = inner.confidences
            lengths[rows] = torch.tensor(inner.drafted(block_size))
            for i, r in enumerate(drafted):
                probs[r] = inner.probs[i]
        return Drafts(tokens, confidences, probs, lengths)

    def _propose_drafted(self, seqs: Seq[Sequence], length: int) -> Drafts:
        """The drafter's block for every request of `seqs` (`propose` without copies)."""
        block_size = self.block_size
        num_requests = len(seqs)
        block = torch.full((num_requests, block_size), self.drafter.config.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([s.anchor for s in seqs])
        starts = [s.num_cached for s in seqs]
        pages = [s.pages for s in seqs]
        stopping = self.stop_survival > 0.0
        if all(s.params.greedy for s in seqs):
            drafted = None
            if self.graphs is not None:
                drafted = self.graphs.run(block.flatten(), pages, starts)
            if drafted is None:
                drafted = self._greedy_block(*self._eager_block_inputs(block, pages, starts), length)
            # Copies: a graph's outputs are rewritten by its next replay.
            tokens, confidences, lengths = (t.clone() for t in drafted)
            if length < block_size:
                # A graph (or a GPU's decode) drafted the whole block: keep the first `length`.
                tokens[:, length:] = 0
                confidences[:, length:] = 0.0
                lengths = torch.clamp(lengths, max=length)
            lengths = lengths.cpu() if stopping or length < block_size else None
            return Drafts(tokens, confidences, [None] * num_requests, lengths)
        heads = self._block_heads(*self._eager_block_inputs(block, pages, starts), length)
        return self._decode_block(heads, to_device(block[:, 0].contiguous(), self.device), seqs, length)

    def _eager_block_inputs(
        self, block: torch.Tensor, pages: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """What a block pass outside a graph takes: block ids and positions [R * block_size] on the device,
        and every request's block laid out (block_size positions from its first uncached one, seeing the
        whole block). A replayed block lays itself out on the device instead."""
        batch = AttentionBatch.build(
            pages,
            starts,
            [self.block_size] * len(starts),
            self.page_size,
            False,
            self.device,
            rotary_table=self.drafter.cos_sin,
        )
        # The layout's own positions: a CPU layout's rotary multipliers are made for that tensor.
        assert batch.positions is not None
        return to_device(block.flatten(), self.device), batch.positions, batch

    def _block_heads(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        length: int | None = None,
    ) -> BlockHeads:
        """The block pass, with the base logits of the positions the decode reads projected in one
        product (the LM head read once a block). length: the CPU decodes only that many positions (a
        GPU decodes them all, `_greedy_block`)."""
        embeddings = F.embedding(block_ids, self.embedding)
        heads = self.drafter.block_pass(
            embeddings,
            positions,
            batch,
            self.cache,
            self.draft_head,
            self.block_size,
            self._anchor_rows(positions, batch),
        )
        heads.project_all(None if self._on_gpu else length)
        return heads

    def _anchor_rows(self, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor | None:
        """Each block's anchor feature: the context row of the position before its anchor, at that
        position's cache slot (device work only: a replayed block computes it from its layout). None
        for a drafter without one."""
        if self.context_rows is None:
            return None
        before = (positions.view(-1, self.block_size)[:, 0] - 1).clamp(min=0)
        table = batch.page_table[: before.shape[0]]
        pages = table.gather(1, (before // self.page_size)[:, None])[:, 0].long()
        return self.context_rows[pages * self.page_size + before % self.page_size]

    def _greedy_block(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A greedy block for every request, device work only (what a draft graph captures): drafts
        [R, block_size] int64, confidences [R, block_size] fp32 and drafted lengths [R] int64, on the
        device. length: on the CPU, positions past it are left undrafted (a GPU drafts them all)."""
        heads = self._block_heads(block_ids, positions, batch, length)
        anchors = block_ids.view(-1, self.block_size)[:, 0]
        if self._on_gpu:
            return self._greedy_decode(heads, anchors)
        tokens, confidences, stop = self._markov_decode(heads, anchors, length=length)
        return tokens, confidences, stop.lengths

    def _greedy_decode(
        self, heads: BlockHeads, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The greedy Markov decode as a GPU runs it, in few kernels: the drafts first
        (`ops.markov_decode`: the block's base logits projected in one GEMM, then one launch a
        position), then the confidences and the early stop for every position at once (they never
        change a draft, and a block's confidences depend on its own drafts only). Drafts [R, block_size],
        confidences [R, block_size] (zero past each request's stop), drafted lengths [R]."""
        assert heads.projected is not None, "a GPU block pass projects every position (_block_heads)"
        w1, w2 = self.drafter.markov_w1, self.drafter.markov_w2
        if self.draft_w1 is None or self.draft_w2 is None:  # every token, or no Markov head (argmax)
            w1_rows, w2_rows = (None, None) if w1 is None or w2 is None else (w1.weight, w2.weight)
            tokens = self._token_ids(ops.markov_decode(heads.projected, anchors, w1_rows, w2_rows))
        else:
            # The kernel looks W1 up by each draft's index in the draft vocabulary, and by the anchor
            # for the first draft: the anchor (any token) gets a row of its own past the K draft rows.
            assert w1 is not None
            num_draft = self.draft_w1.shape[0]
            w1_rows = torch.cat([self.draft_w1, w1.weight[anchors]])
            anchor_rows = torch.arange(num_draft, num_draft + anchors.shape[0], device=anchors.device)
            tokens = self._token_ids(ops.markov_decode(heads.projected, anchor_rows, w1_rows, self.draft_w2))
        # The token before each position: the anchor, then the drafts.
        before = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        confidences = self.drafter.confidence_at(
            heads.hidden, self.drafter.markov_features(before), slice(0, self.block_size)
        )
        lengths, confidences = stop_all_at_once(confidences, self.stop_survival)
        return tokens, confidences, lengths

    def _decode_block(
        self, heads: BlockHeads, anchors: torch.Tensor, seqs: Seq[Sequence], length: int | None = None
    ) -> Drafts:
        """The Markov decode of a block with sampling requests in it: they draw their drafts with their
        own generators (on the engine's device), one request at a time, so this path runs eagerly.
        Their draft distributions stay on the device, where acceptance reads them."""
        block_size, vocab = self.block_size, self.lm_head.shape[0]
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        probs: list[torch.Tensor | None] = [
            None if s.params.greedy else torch.zeros(block_size, vocab, device=self.device) for s in seqs
        ]

        def choose(k: int, logits: torch.Tensor, stop: _EarlyStop) -> torch.Tensor:
            chosen = logits.argmax(dim=-1)
            # A stopped request draws no more random numbers: its stream must not depend on its batch.
            drafting = stop.lengths.tolist() if stop.enabled else None
            for r in sampled:
                if drafting is not None and drafting[r] <= k:
                    continue
                seq = seqs[r]
                row = filtered_probs(logits[r : r + 1], seq.params)
                # The draft distribution over the whole vocabulary (zero outside a draft vocabulary).
                if self.vocab_ids is None:
                    probs[r][k] = row[0]  # type: ignore[index]
                else:
                    probs[r][k].index_copy_(0, self.vocab_ids, row[0])  # type: ignore[union-attr]
                chosen[r] = sample_rows(row, seq.generator)[0]
            return chosen

        tokens, confidences, stop = self._markov_decode(heads, anchors, choose, length)
        capped = length is not None and length < self.block_size
        lengths = stop.lengths.cpu() if stop.enabled or capped else None
        return Drafts(tokens.cpu(), confidences, probs, lengths)

    def _markov_decode(
        self,
        heads: BlockHeads,
        anchors: torch.Tensor,
        choose: Callable[[int, torch.Tensor, _EarlyStop], torch.Tensor] | None = None,
        length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, _EarlyStop]:
        """Left-to-right Markov decode of every request's block from its anchor [R]: drafts [R, block_size]
        and confidences [R, block_size] on the device (filled there and moved to the host once: a copy per
        position would make the host wait block_size times a step), and the early stop's state. `choose`
        (position, corrected logits [R, draft vocab], stop) picks each position's drafts as indices into
        the draft vocabulary; None: argmax.
        length: decode only the first `length` positions (zeros past them; every request's drafted
        length at most `length`)."""
        num_requests, block_size = anchors.shape[0], self.block_size
        tokens = torch.zeros(num_requests, block_size, dtype=torch.long, device=self.device)
        confidences = torch.zeros(num_requests, block_size, dtype=torch.float32, device=self.device)
        previous = anchors
        stop = _EarlyStop(self.stop_survival, num_requests, block_size, self.device)
        for k in range(block_size if length is None else min(length, block_size)):
            markov = self.drafter.markov_features(previous)
            confidence = stop.update(self.drafter.confidence_at(heads.hidden[:, k], markov, k), k)
            # On the CPU, leave the loop once every request has stopped (saves the vocabulary
            # projections); on a GPU, asking would make the host wait for the device each position.
            if not self._on_gpu and stop.all_stopped():
                break
            confidences[:, k] = confidence
            logits = self.drafter.corrected_logits(heads.logits_at(k), markov, self.draft_w2)
            previous = self._token_ids(logits.argmax(dim=-1) if choose is None else choose(k, logits, stop))
            tokens[:, k] = previous
        if length is not None and length < block_size:
            stop.cap(length)
        return tokens, confidences, stop

    def _token_ids(self, draft_indices: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into the draft vocabulary (the same tensor without one)."""
        return draft_indices if self.vocab_ids is None else self.vocab_ids[draft_indices]


def stop_all_at_once(confidences: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_EarlyStop` over a whole block at once: (drafted lengths [R] int64, the confidences [R, block_size]
    zeroed from each request's stop on). A request stops before the first draft k whose survival (the
    product of c_1..c_k) falls below `threshold` (0: never). Device tensors only, no host sync."""
    num_requests, block_size = confidences.shape
    if threshold <= 0.0:
        whole = torch.full((num_requests,), block_size, dtype=torch.long, device=confidences.device)
        return whole, confidences
    below = torch.cumprod(confidences, dim=1) < threshold
    lengths = torch.where(below.any(dim=1), below.int().argmax(dim=1), block_size).long()
    kept = torch.arange(block_size, device=confidences.device)[None, :] < lengths[:, None]
    return lengths, torch.where(kept, confidences, 0.0)


class _EarlyStop:
    """Early stop of drafting: draft k is made only while the survival of drafts 1..k (the product of
    their confidences, known before draft k is chosen) stays >= `threshold` (0: never stop).

    Each request's stop depends on its own earlier drafts only, a stopping time of the draft process,
    so verifying the drafts made stays lossless; the vocabulary projections of skipped positions are
    saved on the CPU. Device tensors only, no host sync: safe inside a CUDA graph."""

    def __init__(self, threshold: float, num_requests: int, block_size: int, device: torch.device) -> None:
        self.enabled = threshold > 0.0
        self.threshold = threshold
        self.block_size = block_size
        self.survival = torch.ones(num_requests, device=device)
        # Drafted positions per request (block_size: still drafting).
        self.lengths = torch.full((num_requests,), block_size, dtype=torch.long, device=device)

    def cap(self, length: int) -> None:
        """After the decode: no request drafted past `length` positions (the step verifies no more)."""
        self.lengths = torch.clamp(self.lengths, max=length)

    def update(self, confidence: torch.Tensor, k: int) -> torch.Tensor:
        """Take c_k; return it with stopped requests' entries zeroed (no draft there: never verified)."""
        if not self.enabled:
            return confidence
        self.survival = self.survival * confidence
        stop_here = (self.survival < self.threshold) & (self.lengths == self.block_size)
        self.lengths = torch.where(stop_here, k, self.lengths)
        return torch.where(self.lengths > k, confidence, 0.0)

    def all_stopped(self) -> bool:
        """Whether no request drafts any more (a host sync: CPU only)."""
        return self.enabled and not bool((self.lengths == self.block_size).any())
