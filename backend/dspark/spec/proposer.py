"""Proposers: what drafts a block for every decoding request. DSparkProposer runs the drafter."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark.attention_batch import AttentionBatch
from dspark.kv_cache import PagedKVCache
from dspark.sampling import filtered_probs, sample_rows
from dspark.sequence import Sequence
from dspark.spec.drafter import Drafter


@dataclass
class DraftProposal:
    """One block of drafts per request.

    tokens: [R, gamma] int64 on the host; confidences: [R, gamma] fp32 on the drafter's device (c_k,
    the chance draft k survives given the earlier ones did; the planner reads them there); probs[r]:
    [gamma, vocab] the distributions request r's drafts were sampled from (None for greedy requests,
    whose drafts are argmax choices).
    """

    tokens: torch.Tensor
    confidences: torch.Tensor
    probs: list[torch.Tensor | None]
    # Drafted positions per request [R] int64 on the host (None: the whole block). Positions past a
    # request's length hold no draft (confidence 0) and must not be verified.
    lengths: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts blocks and keeps whatever context it needs from the target's committed hidden states."""

    block_size: int
    target_layer_ids: list[int]

    def propose(self, seqs: Seq[Sequence]) -> DraftProposal:
        """Draft one block per sequence (each has `num_cached` context positions and an anchor)."""
        ...

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Take the target features [num_tokens, L * hidden] of committed positions into the context."""
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
    ) -> None:
        cfg = drafter.config
        device = drafter.fc.weight.device
        self.drafter = drafter
        # The target's full embedding and LM head [vocab, hidden]: shared, never copied.
        self.embedding = embedding
        self.lm_head = lm_head
        self.block_size = cfg.block_size
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
        # A request stops drafting once the survival of its next draft falls below this (0: never).
        self.stop_survival = stop_survival
        self._on_gpu = device.type == "cuda"

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """KV injection of committed target features into every drafter layer."""
        if features.shape[0]:
            self.drafter.inject_context(features, positions, slots, self.cache)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence]) -> DraftProposal:
        """Block pass, then left-to-right Markov decode with confidences."""
        gamma = self.block_size
        mask_id = self.drafter.config.mask_token_id
        num_requests = len(seqs)
        block = torch.full((num_requests, gamma), mask_id, dtype=torch.long)
        block[:, 0] = torch.tensor([s.anchor for s in seqs])
        starts = [s.num_cached for s in seqs]
        positions = (torch.tensor(starts)[:, None] + torch.arange(gamma)[None, :]).flatten()
        batch = AttentionBatch.build(
            [s.pages for s in seqs], starts, [gamma] * num_requests, self.page_size, False, self.device
        )
        embeddings = F.embedding(block.flatten().to(self.device), self.embedding)
        heads = self.drafter.block_pass(
            embeddings, positions.to(self.device), batch, self.cache, self.lm_head
        )
        # Filled on the drafter's device and moved to the host once: a copy per block position would
        # make the host wait for the device gamma times a step.
        tokens = torch.zeros(num_requests, gamma, dtype=torch.long, device=self.device)
        confidences = torch.zeros(num_requests, gamma, dtype=torch.float32, device=self.device)
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        vocab = heads.lm_head.shape[0]
        probs: list[torch.Tensor | None] = [
            None if s.params.greedy else torch.zeros(gamma, vocab) for s in seqs
        ]
        previous = block[:, 0].to(self.device)
        # Early stop: draft k is made only while the survival of drafts 1..k (the product of their
        # confidences, known before draft k is chosen) stays >= stop_survival. Each request's stop
        # depends on its own earlier drafts only, a stopping time of the draft process, so verifying
        # the drafts made stays lossless; the vocabulary projections of skipped positions are saved.
        stopping = self.stop_survival > 0.0
        survival = torch.ones(num_requests, device=self.device)
        lengths = torch.full((num_requests,), gamma, dtype=torch.long, device=self.device)
        for k in range(gamma):
            markov = self.drafter.markov_features(previous)
            confidence = self.drafter.confidence_at(heads.hidden[:, k], markov, k)
            if stopping:
                survival = survival * confidence
                stop_here = (survival < self.stop_survival) & (lengths == gamma)
                lengths = torch.where(stop_here, k, lengths)
                # On the CPU, leave the loop once every request has stopped (saves the vocabulary
                # projections); on a GPU, asking would make the host wait for the device each position.
                if not self._on_gpu and not bool((lengths == gamma).any()):
                    break
                confidence = torch.where(lengths > k, confidence, 0.0)  # no draft here: never verified
            confidences[:, k] = confidence
            logits = self.drafter.corrected_logits(heads.logits_at(k), markov)
            chosen = logits.argmax(dim=-1)
            # A stopped request draws no more random numbers: its stream must not depend on its batch.
            drafting = lengths.tolist() if stopping and sampled else None
            for r in sampled:
                if drafting is not None and drafting[r] <= k:
                    continue
                seq = seqs[r]
                row = filtered_probs(logits[r : r + 1], seq.params)
                probs[r][k] = row[0].cpu()  # type: ignore[index]
                chosen[r] = sample_rows(row, seq.generator)[0]
            tokens[:, k] = chosen
            previous = chosen
        return DraftProposal(tokens.cpu(), confidences, probs, lengths.cpu() if stopping else None)
