"""The DSpark objective on one batch of blocks.

Per block position k (0-based; slot k predicts the token after position anchor + k):
- cross-entropy of the Markov-corrected logits U_k + W2 · W1[x_{k-1}] against the true next token, with
  teacher forcing (x_{k-1} is the true token at anchor + k; the anchor itself for k = 0), or, with
  `ce_target="target"`, against the target's distribution there (a soft label: the data's next token is
  one draw of it when the answer was sampled at temperature 1, the argmax when greedy), or, with
  `ce_target="argmax"`, against the target's argmax there (the token greedy verification accepts: the
  label greedy tau counts, where the soft label also spends the drafter on the distribution's tail);
- the L1 distance between the draft and target distributions, ‖p_d − p_t‖₁;
- binary cross-entropy of the confidence head against 1 − ½‖p_d − p_t‖₁, the chance that speculative
  sampling accepts the draft.
Each position is weighted by exp(−k / decay): early drafts gate every later one.

With a draft vocabulary (`BlockTargets.vocab`: the K token ids the served drafter drafts from,
`dspark.spec.draft_vocab`) the drafter's distribution is over those K tokens only, as it is served: its
logits read K rows of the LM head (and of the Markov head's W2), the cross-entropy against the target's
distribution sums over the K tokens (its minimiser is the target's distribution there, renormalised), and
the L1 distance adds the target's mass outside them, which no draft can take. The drafter's largest
tensors, [blocks, positions, vocabulary] fp32 and their gradients, shrink by vocab / K (6x for SmolLM2 at
K 8192), and no step spends its capacity on tokens it will never draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.spec.drafter import Drafter
from dspark.training.draft_forward import confidence_logits

CE_TARGETS = ("data", "target", "argmax")


@dataclass
class LossWeights:
    """How the three terms and the block positions are weighted, and what the cross-entropy is against."""

    l1: float = 1.0
    confidence: float = 0.5
    decay: float = 4.0
    # What the cross-entropy's label is: "target" (the target's distribution at that position, which the
    # L1 term computes anyway), "data" (the next token of the training sequence) or "argmax" (the
    # target's most likely token there). target against data: the same steps from scratch gave +3%
    # held-out tau (H200, 2026-12-03, training/variants.sh); argmax against target: +0.8%, within noise
    # (session 26, RESULTS.md).
    ce_target: str = "target"

    def __post_init__(self) -> None:
        if self.ce_target not in CE_TARGETS:
            raise ValueError(f"ce_target: one of {CE_TARGETS}, got {self.ce_target!r}")


@dataclass
class BlockTargets:
    """What the drafter is trained against, per block position: all [N, block_size] except target_logits.

    previous: x_{k-1} (true tokens); labels: the true next tokens; target_logits: [N, block_size, vocab] the
    target's logits for the same next tokens, or [N, block_size, K] those of the draft vocabulary's tokens
    when `vocab` ([K] sorted token ids) is given, with `target_lse` [N, block_size] the log-sum-exp of the
    target's logits over every token; target_choice: the target's argmax over every token; valid:
    positions that have a next token.
    """

    previous: torch.Tensor
    labels: torch.Tensor
    target_logits: torch.Tensor
    valid: torch.Tensor
    target_choice: torch.Tensor
    vocab: torch.Tensor | None = None
    target_lse: torch.Tensor | None = None

    def target_probs(self) -> torch.Tensor:
        """p_t over the logits' last axis (every token, or the draft vocabulary's): fp32."""
        if self.target_lse is None:
            return torch.softmax(self.target_logits.float(), dim=-1)
        return torch.exp(self.target_logits.float() - self.target_lse[..., None].float())


@dataclass
class LossParts:
    """The total loss and its parts (weighted means over valid positions); survival: [block_size] the share of
    whole blocks whose argmax drafts 1..k all equal the target's argmax (teacher forced), so that
    1 + survival.sum() estimates the greedy tokens committed per step."""

    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    survival: torch.Tensor


def position_weights(block_size: int, decay: float, device: torch.device) -> torch.Tensor:
    """exp(−k / decay) for k = 0 .. block_size − 1: [block_size]."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / decay)


def dspark_loss(
    drafter: Drafter, hidden: torch.Tensor, lm_head: torch.Tensor, targets: BlockTargets, weights: LossWeights
) -> LossParts:
    """The DSpark loss of blocks whose final drafter states are hidden [N, block_size, hidden] (over the
    draft vocabulary when `targets.vocab` names one)."""
    vocab = targets.vocab
    markov = drafter.markov_features(targets.previous)
    head = lm_head if vocab is None else lm_head[vocab]
    w2_rows = None if vocab is None or drafter.markov_w2 is None else drafter.markov_w2.weight[vocab]
    logits = drafter.corrected_logits(F.linear(hidden, head.to(hidden.dtype)).float(), markov, w2_rows)
    log_pd = torch.log_softmax(logits, dim=-1)
    p_t = targets.target_probs()
    target_choice = targets.target_choice  # the argmax label and the survival's reference
    valid = targets.valid
    if weights.ce_target == "target":
        ce = -(p_t * log_pd).sum(-1)
    else:
        labels = targets.labels if weights.ce_target == "data" else target_choice
        if vocab is not None:
            # A label outside the draft vocabulary has no logit: its position leaves the cross-entropy.
            labels, drafted = vocab_index(vocab, labels)
            valid = valid & drafted
        ce = -log_pd.gather(-1, labels[..., None]).squeeze(-1)
    l1 = (log_pd.exp() - p_t).abs().sum(-1)
    if vocab is not None:  # the target's mass outside the draft vocabulary: no draft takes it
        l1 = l1 + (1.0 - p_t.sum(-1)).clamp(min=0.0)
    # The confidence head reads the drafter without steering it: its inputs and target are detached.
    acceptance = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf_logit = confidence_logits(drafter, hidden.detach(), None if markov is None else markov.detach())
    bce = F.binary_cross_entropy_with_logits(conf_logit, acceptance, reduction="none")
    w = position_weights(hidden.shape[1], weights.decay, hidden.device)[None, :] * targets.valid
    norm = w.sum().clamp_min(1e-9)
    w_ce = w * valid  # w where every label has a logit; fewer positions where some are outside
    ce_mean = (w_ce * ce).sum() / w_ce.sum().clamp_min(1e-9)
    l1_mean, bce_mean = ((w * term).sum() / norm for term in (l1, bce))
    total = ce_mean + weights.l1 * l1_mean + weights.confidence * bce_mean
    with torch.no_grad():
        drafts = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
        hit = drafts == target_choice
        whole = targets.valid.all(dim=-1)
        survival = hit[whole].float().cumprod(dim=-1).sum(0) / whole.sum().clamp_min(1)
    return LossParts(total, ce_mean.detach(), l1_mean.detach(), bce_mean.detach(), survival)


def vocab_index(vocab: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's index in the sorted draft vocabulary `vocab` ([K] ids), and whether it is there
    (an absent token's index is 0, to be masked)."""
    index = torch.searchsorted(vocab, token_ids).clamp(max=vocab.shape[0] - 1)
    present = vocab[index] == token_ids
    return torch.where(present, index, 0), present
