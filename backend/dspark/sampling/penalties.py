"""vLLM's presence, frequency and repetition penalties and `min_tokens`, on the target's logits.

They apply wherever the target's distribution is judged: the prefill's first token and every row of a
verify window. Row i of a window [anchor, d_1, ..., d_l] is the distribution after d_1..d_i, so its
history is the prompt, the committed output and those drafts, exactly the history it has when they
are accepted; a plain (non-speculative) step is the one-row case. Speculation therefore changes none
of the distributions a request is decoded from, and greedy acceptance compares drafts with the
penalized argmax.

Semantics (vLLM's `apply_penalties` and min-tokens logits processor) for one fp32 row, with c the
counts of the output tokens in its history and P the prompt's tokens:
  - min_tokens m: while fewer than m output tokens come before the row's token, EOS and the request's
    stop_token_ids get -inf (EOS even with ignore_eos, as vLLM's all_stop_token_ids);
  - repetition r: a token in P or with c > 0 has its logit multiplied by 1/r when positive, by r
    otherwise;
  - frequency f and presence p: logit -= f * c, then logit -= p * (c > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.runner.host_to_device import to_device
from dspark.sampling_params import SamplingParams


class PenaltyState:
    """One penalized request's history on the device: output token counts [vocab] fp32 (exact to
    2**24) and the prompt's tokens as a mask [vocab] bool."""

    def __init__(self, prompt: list[int], output: list[int], vocab: int, device: torch.device) -> None:
        self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.prompt_mask[to_device(torch.tensor(prompt, dtype=torch.long), device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.commit(output)

    def commit(self, tokens: Sequence[int]) -> None:
        """Count newly committed output tokens."""
        if tokens:
            ids = to_device(torch.tensor(tokens, dtype=torch.long), self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.counts.device))


@dataclass
class PenaltyWindow:
    """One request's consecutive logit rows in a step (a verify window or a prefill's last row).

    first_row / num_rows: where they are; num_output: output tokens committed before the first row's
    token; state: its history counts (None: min_tokens only); draft_row: its row in the step's drafts
    (the history rows 1.. add, -1: none); stop_ids: what min_tokens masks."""

    first_row: int
    num_rows: int
    params: SamplingParams
    num_output: int
    state: PenaltyState | None
    draft_row: int
    stop_ids: list[int]

    def min_tokens_rows(self) -> int:
        """How many of the window's first rows min_tokens masks."""
        return max(0, min(self.num_rows, self.params.min_tokens - self.num_output))


def window_needs_adjusting(params: SamplingParams, num_output: int) -> bool:
    """Whether a request's next rows need penalties or min_tokens (cheap: host numbers only)."""
    return params.penalized or num_output < params.min_tokens


def apply_penalties(
    logits: torch.Tensor, windows: Sequence[PenaltyWindow], drafts: torch.Tensor | None
) -> torch.Tensor | None:
    """Adjust the windows' rows of `logits` [rows, vocab] fp32 in place; return the adjusted rows as
    a device index [n] (None when none were), for the caller to refresh their argmax.

    drafts: [num windows with drafts, >= longest window - 1] the step's draft tokens (any device), whose
    row `window.draft_row` holds window's d_1.. (None when no window has drafts)."""
    device = logits.device
    _mask_stop_tokens(logits, windows)
    penalized = [w for w in windows if w.state is not None]
    if penalized:
        _penalize(logits, penalized, drafts)
    rows = sorted(
        {w.first_row + i for w in penalized for i in range(w.num_rows)}
        | {w.first_row + i for w in windows for i in range(w.min_tokens_rows())}
    )
    return to_device(torch.tensor(rows, dtype=torch.long), device) if rows else None


def _mask_stop_tokens(logits: torch.Tensor, windows: Sequence[PenaltyWindow]) -> None:
    """min_tokens: -inf at the stop ids of every row before the request's min_tokens-th output token."""
    rows: list[int] = []
    ids: list[int] = []
    for w in windows:
        for i in range(w.min_tokens_rows()):
            rows.extend([w.first_row + i] * len(w.stop_ids))
            ids.extend(w.stop_ids)
    if rows:
        index = to_device(torch.tensor([rows, ids], dtype=torch.long), logits.device)
        logits[index[0], index[1]] = float("-inf")


def _penalize(logits: torch.Tensor, windows: Sequence[PenaltyWindow], drafts: torch.Tensor | None) -> None:
    """Repetition, frequency and presence penalties of every row of `windows` (each with a state)."""
    device = logits.device
    window_of_row: list[int] = []
    window_start: list[int] = []
    draft_index: list[int] = []  # per row: the flat index of its own token among the drafts (-1: none)
    width = drafts.shape[1] if drafts is not None else 0
    for w_index, w in enumerate(windows):
        start = len(window_of_row)
        for i in range(w.num_rows):
            window_of_row.append(w_index)
            window_start.append(start)
            has_draft = i > 0 and w.draft_row >= 0
            draft_index.append(w.draft_row * width + i - 1 if has_draft else -1)
    rows = [w.first_row + i for w in windows for i in range(w.num_rows)]
    scalars = [
        (w.params.repetition_penalty, w.params.frequency_penalty, w.params.presence_penalty)
        for w in windows
        for _ in range(w.num_rows)
    ]
    meta = to_device(torch.tensor([rows, window_of_row, window_start, draft_index], dtype=torch.long), device)
    row_index, row_window, row_start, row_draft = meta
    counts = torch.stack([w.state.counts for w in windows])[row_window]  # type: ignore[union-attr]
    in_prompt = torch.stack([w.state.prompt_mask for w in windows])[row_window]  # type: ignore[union-attr]
    if drafts is not None and any(i >= 0 for i in draft_index):
        # Row i's history adds d_1..d_i: a one-hot of each row's own draft, summed down its window.
        flat = to_device(drafts, device).reshape(-1)
        own = flat[row_draft.clamp(min=0)]
        one_hot = torch.zeros_like(counts).scatter_(1, own[:, None], (row_draft >= 0).float()[:, None])
        running = one_hot.cumsum(0)
        counts = counts + running - running[row_start]  # a window's first row has no draft
    values = to_device(torch.tensor(scalars, dtype=torch.float32), device)
    repetition, frequency, presence = values[:, 0:1], values[:, 1:2], values[:, 2:3]
    seen = counts > 0
    rows_logits = logits[row_index]
    penalties = torch.where(in_prompt | seen, repetition, 1.0)
    rows_logits *= torch.where(rows_logits > 0, 1.0 / penalties, penalties)
    rows_logits -= frequency * counts
    rows_logits -= presence * seen
    logits[row_index] = rows_logits
