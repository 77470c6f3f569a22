"""The DSpark drafter: target-feature KV injection, a non-causal block pass, Markov and confidence heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import ops
from dspark.parallel.distributed import SINGLE
from dspark.runner.attention_batch import AttentionBatch
from dspark.runner.kv_cache import PagedKVCache
from dspark.runner.models.layers import RMSNorm, linear, rotary_cos_sin
from dspark.runner.models.llama import DecoderLayer
from dspark.spec.draft_config import DraftConfig


@dataclass
class BlockHeads:
    """What the Markov/confidence decode needs from one block pass.

    hidden: [R, block_size, hidden] final normed drafter states; lm_head: the shared [vocab, hidden] head.
    `project_all` projects the positions a decode will read in one product, reading the LM head (the
    drafter's largest read: 1.2 GB for a Qwen3-8B vocabulary) once a block rather than once a
    position; the proposer does before it decodes (on the CPU too: there the product of 3 positions
    took 0.75 ms against 0.58 ms for one at batch 1, so it pays unless most blocks stop before their
    second draft).
    """

    hidden: torch.Tensor
    lm_head: torch.Tensor
    # [R, positions, vocab] in the head's dtype once `project_all` ran.
    projected: torch.Tensor | None = None

    def project_all(self, num_positions: int | None = None) -> None:
        """Project the first `num_positions` block positions (None: all) now, in one product."""
        hidden = self.hidden if num_positions is None else self.hidden[:, :num_positions]
        self.projected = linear(hidden, self.lm_head)

    def logits_at(self, position: int) -> torch.Tensor:
        """U_k, the base logits of block position `position` (one `project_all` projected): [R, vocab]
        fp32."""
        assert self.projected is not None, "project_all first"
        return self.projected[:, position].float()

    @property
    def base_logits(self) -> torch.Tensor:
        """U for every position: [R, block_size, vocab] fp32."""
        return linear(self.hidden, self.lm_head).float()


class Drafter(nn.Module):
    """Drafter layers (Qwen3-style) whose context keys/values come from the target's hidden states.

    Embeddings and LM head are the target's (shared, frozen); they are passed in, never owned. The
    drafter is small and runs on the driver only, replicated rather than tensor-parallel.
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        layer_cfg = cfg.layer_config
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, SINGLE) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        r = cfg.markov_rank
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r) if r else None
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False) if r else None
        self.confidence = nn.Linear(h + r, 1) if cfg.enable_confidence_head else None
        # The anchor's context row into every block position's input (`DraftConfig.anchor_feature`).
        self.anchor_fc = nn.Linear(h, h, bias=False) if cfg.anchor_feature else None
        self.register_buffer(
            "confidence_temperatures", torch.tensor(cfg.confidence_temperatures, dtype=torch.float32)
        )
        self.register_buffer(
            "cos_sin",
            rotary_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta),
            persistent=False,
        )

    @property
    def num_kv_heads(self) -> int:
        """KV heads of every drafter layer."""
        return self.config.num_key_value_heads

    def inject_context(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: PagedKVCache,
        context_rows: torch.Tensor | None = None,
    ) -> None:
        """KV injection: project target features into every drafter layer's keys/values.

        features: [num_tokens, len(target_layer_ids) * hidden] target hidden states of committed
        positions; positions, slots: [num_tokens]. Writes each layer's k/v at those slots, and with
        `context_rows` ([cache slots + 1, hidden], an anchor feature's) each token's context row at its
        slot (a padding token's, slot -1, into the last row, never read).
        """
        features = features.to(self.fc.weight.dtype)
        # On the CPU through `linear`, whose measured paths beat F.linear there by up to 3x.
        projected = linear(features, self.fc.weight) if features.device.type == "cpu" else self.fc(features)
        ctx, _ = self.hidden_norm(projected)
        if context_rows is not None:
            rows = torch.where(slots >= 0, slots, context_rows.shape[0] - 1)
            context_rows.index_copy_(0, rows, ctx.to(context_rows.dtype))
        n, d = ctx.shape[0], self.config.head_dim
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
            kv = linear(ctx, attn.qkv_proj.weight[q_size:])
            k, v = kv.split([kv_size, kv_size], dim=-1)
            k_cache, v_cache = cache.layer(index)
            ops.inject_kv(
                k.reshape(n, attn.num_kv_heads, d),
                v.reshape(n, attn.num_kv_heads, d),
                attn.k_norm.weight,
                attn.k_norm.eps,
                positions,
                self.cos_sin,
                k_cache,
                v_cache,
                slots,
            )

    def block_pass(
        self,
        block_embeddings: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: PagedKVCache,
        lm_head: torch.Tensor,
        block_size: int = 0,
        anchor_rows: torch.Tensor | None = None,
    ) -> BlockHeads:
        """One non-causal pass over every request's block [anchor, mask, ..., mask].

        block_embeddings: [R * block_size, hidden]; positions: [R * block_size]; the batch's windows
        are the blocks, seeing all injected context before them and the whole block. block_size: the
        positions of a block (0: the trained block size; fewer drafts a shorter block). anchor_rows:
        [R, hidden] each block's anchor feature (the context row of the position before it), for a
        drafter with one.
        """
        block_size = block_size or self.config.block_size
        x, residual = block_embeddings.to(self.fc.weight.dtype), None
        if self.anchor_fc is not None:
            assert anchor_rows is not None, "a drafter with an anchor feature needs its anchor rows"
            x = x + self.anchor_fc(anchor_rows.to(x.dtype)).repeat_interleave(block_size, dim=0)
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, batch, cache.layer(index), self.cos_sin)
        hidden, _ = self.norm(x, residual)
        return BlockHeads(hidden.view(-1, block_size, hidden.shape[-1]), lm_head)

    def markov_features(self, previous_tokens: torch.Tensor) -> torch.Tensor | None:
        """W1[x_{k-1}]: [R, rank] low-rank embedding of the previously chosen tokens (None when r = 0)."""
        return None if self.markov_w1 is None else self.markov_w1(previous_tokens)

    def corrected_logits(
        self, base_logits: torch.Tensor, markov: torch.Tensor | None, w2_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """U_k + W2 · W1[x_{k-1}]: [R, vocab] fp32. w2_rows: the rows of W2 of a reduced draft
        vocabulary (`spec.draft_vocab`), the ones base_logits holds; None: all of them."""
        if markov is None or self.markov_w2 is None:
            return base_logits
        w2 = self.markov_w2.weight if w2_rows is None else w2_rows
        return base_logits + F.linear(markov, w2).float()

    def confidence_logit(self, hidden: torch.Tensor, markov: torch.Tensor | None) -> torch.Tensor:
        """w · [h_k ; W1[x_{k-1}]] + b, the confidence head before its sigmoid and temperature: hidden
        [..., hidden], markov [..., rank] (or None) -> [...] fp32."""
        assert self.confidence is not None
        inputs = hidden if markov is None else torch.cat([hidden, markov.to(hidden.dtype)], dim=-1)
        return self.confidence(inputs).float().squeeze(-1)

    def confidence_at(
        self, hidden: torch.Tensor, markov: torch.Tensor | None, position: int | slice
    ) -> torch.Tensor:
        """c_k = sigmoid((w · [h_k ; W1[x_{k-1}]] + b) / T_k) of one block position (hidden [R, hidden]
        -> [R]) or of a slice of them (hidden [R, n, hidden] -> [R, n]); all ones without a confidence
        head."""
        if self.confidence is None:
            return torch.ones(hidden.shape[:-1], device=hidden.device)
        return torch.sigmoid(self.confidence_logit(hidden, markov) / self.confidence_temperatures[position])
