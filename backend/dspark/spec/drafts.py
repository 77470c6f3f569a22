"""Drafts: one block of drafts per decoding request, the value the draft stage of a step produces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runner.verify_tokens import write_verify_tokens


@dataclass(frozen=True)
class Drafts:
    """One block of drafts per request (request r's row r).

    tokens: [R, block_size] int64, on the drafter's device for greedy blocks (nothing waits to read
    them back before the target step; device acceptance reads them there) or on the host;
    confidences: [R, block_size] fp32 on the drafter's device (c_k, the chance draft k survives given
    the earlier ones did; the planner reads them there); probs[r]: [block_size, vocab] the
    distributions request r's drafts were sampled from, on the drafter's device (None for greedy
    requests, whose drafts are argmax choices). Drafts made inside a captured step are views of a
    graph's outputs, valid until its next replay (the step that drafted them accepts them first).
    """

    tokens: torch.Tensor
    confidences: torch.Tensor
    probs: list[torch.Tensor | None]
    # Drafted positions per request [R] int64 on the host (None: the whole block). Positions past a
    # request's length hold no draft (confidence 0) and must not be verified. Drafts made inside the
    # target step fill it by a queued copy (`to_host_queued`): read it once the step is accepted.
    lengths: torch.Tensor | None = None

    @property
    def num_windows(self) -> int:
        """The verify windows these drafts fill (one per request), for `VerifyDrafts`."""
        return self.tokens.shape[0]

    def pack(
        self, token_ids: torch.Tensor, window_lens: list[int], out: torch.Tensor, in_layout: bool
    ) -> None:
        """`VerifyDrafts.pack`: write the windows' anchors and drafts into `out`; nothing is drafted."""
        write_verify_tokens(token_ids, window_lens, self.tokens, out)

    def drafted(self, block_size: int) -> list[int]:
        """Per request: the positions it drafted, at most `block_size` (its statistics)."""
        if self.lengths is None:
            return [block_size] * self.num_windows
        return [min(block_size, n) for n in self.lengths.tolist()]
