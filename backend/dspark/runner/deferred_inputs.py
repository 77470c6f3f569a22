"""DeferredInputs: the inputs a step takes from the step before it, which is not yet accepted.

With overlap scheduling the engine may launch step N+1 before it has read step N's acceptance back
(`LLMEngine._launch_ahead`). A request decoding in both then has two unknowns when N+1 is packed: how
many drafts N accepted (its N+1 window starts that much later) and the token N committed last (N+1's
anchor). Both are on the device, where N's acceptance ran; N+1 is packed as if N accepted nothing,
and the runner adds the difference on the device right after copying the step in and before anything
reads the layout (the target graphs' `compute`, an in-step draft block, the eager layout), so the host
never waits for N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runner.host_to_device import to_device


@dataclass(frozen=True)
class DeferredInputs:
    """For the windows of a step that follow an output of the step before it: which windows, their
    anchor rows, and what that earlier step accepted and committed there.

    index: [3, k] int64 on the host: this step's window, the packed row of its anchor, and the output
    of the earlier step it follows; accepted, last_tokens: per output of the earlier step, on the
    device: the drafts it accepted (None: it verified none, so every start stands) and the token it
    committed last (`QueuedGreedyAcceptance.per_output`); in_order: window j follows output j for
    every j (a steady batch: the requests in the same order in both steps)."""

    index: torch.Tensor
    accepted: torch.Tensor | None
    last_tokens: torch.Tensor
    in_order: bool = False

    def apply(
        self, token_ids: torch.Tensor, window_starts: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """Move each following window's start on by the drafts accepted before it, and write its
        anchor, in the device copies of the step (`token_ids` [tokens], `window_starts` [windows]).
        index: `self.index` on the device already (copied in with the step); None copies it here."""
        if index is None:
            index = to_device(self.index, token_ids.device)
        windows, rows, earlier = index
        if self.in_order:  # the outputs are the windows' own, first to last: slices, not gathers
            count = windows.shape[0]
            if self.accepted is not None:
                window_starts[:count].add_(self.accepted[:count])
            token_ids.index_copy_(0, rows, self.last_tokens[:count].to(token_ids.dtype))
            return
        # index_select / index_add_ / index_copy_: four small device ops (advanced indexing made six,
        # each a few microseconds of the host, every step launched ahead); after a plain step, two.
        if self.accepted is not None:
            accepted = self.accepted.index_select(0, earlier).to(window_starts.dtype)
            window_starts.index_add_(0, windows, accepted)
        token_ids.index_copy_(0, rows, self.last_tokens.index_select(0, earlier).to(token_ids.dtype))
