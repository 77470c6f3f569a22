"""Test-only proposers that force the speculative path into chosen cases."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.sampling.sampler import sample_rows
from dspark.sequence import Sequence
from dspark.spec.drafts import Drafts


class OracleProposer:
    """Knows each request's true greedy continuation and drafts it, corrupting chosen block positions.

    truth[request_prompt_tuple] = the full greedy token list (prompt + output); corrupt(seq, step) gives
    the block position to corrupt (None: draft the truth). Confidences come from `confidence(seq, k)`.
    """

    def __init__(
        self,
        truth: dict[tuple[int, ...], list[int]],
        vocab_size: int,
        block_size: int,
        corrupt: Callable[[Sequence, int], int | None],
        confidence: Callable[[Sequence, int], float] = lambda seq, k: 0.9,
    ) -> None:
        self.truth = truth
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.target_layer_ids: list[int] = []
        self.corrupt = corrupt
        self.confidence = confidence
        self.steps: dict[str, int] = {}

    def propose(self, seqs: list[Sequence], length: int | None = None) -> Drafts:
        """Draft the truth after each anchor, one position corrupted when asked."""
        tokens = torch.zeros(len(seqs), self.block_size, dtype=torch.long)
        conf = torch.zeros(len(seqs), self.block_size)
        for r, seq in enumerate(seqs):
            full = self.truth[tuple(seq.prompt_token_ids)]
            start = len(seq.token_ids)
            block = (full[start : start + self.block_size] + [1] * self.block_size)[: self.block_size]
            step = self.steps.get(seq.request_id, 0)
            self.steps[seq.request_id] = step + 1
            bad = self.corrupt(seq, step)
            if bad is not None:
                block[bad] = (block[bad] + 1) % self.vocab_size
            tokens[r] = torch.tensor(block)
            conf[r] = torch.tensor([self.confidence(seq, k) for k in range(self.block_size)])
        return Drafts(
            tokens,
            conf,
            [None if s.params.greedy else _one_hot(tokens[r], self.vocab_size) for r, s in enumerate(seqs)],
        )

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """No context to keep."""


class TrapProposer:
    """Drafts from q = (delta_trigger + delta_argmax_p) / 2, where argmax_p is the target's greedy token
    at the draft's context; confidences c_1 = high and c_k = high iff x_{k-1} == trigger, else low.

    Causal (c_k looks only at earlier drafts), so any correct planner stays lossless; but a planner
    that looks ahead verifies draft 1 exactly when it is the trigger, which biases the output.
    """

    def __init__(self, target, trigger: int, block_size: int, high: float = 0.95, low: float = 0.05) -> None:
        self.target = target
        self.trigger = trigger
        self.block_size = block_size
        self.target_layer_ids: list[int] = []
        self.high, self.low = high, low
        self._greedy: dict[tuple[int, ...], int] = {}

    def _greedy_token(self, context: list[int]) -> int:
        from dspark.runner.models.dense import dense_logits

        key = tuple(context)
        if key not in self._greedy:
            self._greedy[key] = int(dense_logits(self.target, context)[-1].argmax())
        return self._greedy[key]

    def propose(self, seqs: list[Sequence], length: int | None = None) -> Drafts:
        """Draft each block token from q at its context; confidences from the previous draft."""
        vocab = self.target.config.vocab_size
        tokens = torch.zeros(len(seqs), self.block_size, dtype=torch.long)
        conf = torch.zeros(len(seqs), self.block_size)
        probs = []
        for r, seq in enumerate(seqs):
            context = list(seq.token_ids)
            q = torch.zeros(self.block_size, vocab)
            for k in range(self.block_size):
                conf[r, k] = self.high if k == 0 or context[-1] == self.trigger else self.low
                greedy = self._greedy_token(context)
                q[k, self.trigger] += 0.5
                q[k, greedy] += 0.5
                token = int(sample_rows(q[k : k + 1], seq.generator)[0])
                tokens[r, k] = token
                context.append(token)
            probs.append(q)
        return Drafts(tokens, conf, probs)

    def inject(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """No context to keep."""


def _one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab_size).float()
