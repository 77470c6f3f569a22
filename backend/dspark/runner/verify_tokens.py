"""Verify windows whose drafts are still on the device: their packed token ids are written there.

A step's verify windows are [anchor, draft 1, ..., draft n]. The anchors are on the host; the drafts
come out of the drafter on its device. Packing them there (`ops.pack_verify_tokens`, the layout kernel
on a GPU) lets the driver queue the target step right behind the draft block without first waiting to
read the drafts back, so a step that needs no host decision between the two (static verify lengths)
has no host-device round trip until its tokens are committed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dspark.kernels import ops
from dspark.runner.host_to_device import to_device


class VerifyDrafts(Protocol):
    """The drafts of a target step's verify windows, as the runner takes them: the step's first
    `num_windows` windows hold their anchor, then placeholders, which `pack` fills in.

    Drafts made before the step (`spec.drafts.Drafts`) are packed as they are; drafts made inside the
    step (`spec.step_draft.InStepDrafts`) are drafted by `pack`, from the target graphs' static
    layout when the step replays a graph."""

    @property
    def num_windows(self) -> int:
        """How many of the step's windows (the first ones) are verify windows."""
        ...

    def pack(
        self, token_ids: torch.Tensor, window_lens: list[int], out: torch.Tensor, in_layout: bool
    ) -> object:
        """Write the verify windows' token ids into `out` (the step's packed token ids, on any device);
        return the drafts made to do so (None when they were made before the step).

        token_ids, window_lens: the step's host token ids and window lengths; in_layout: `out` is the
        token ids of the target graphs' static layout, filled with this step (`StaticLayout.fill`)."""
        ...


def write_verify_tokens(
    token_ids: torch.Tensor, window_lens: list[int], drafts: torch.Tensor, out: torch.Tensor
) -> None:
    """Write the first len(drafts) windows' tokens into `out` (the packed token ids, on any device).

    token_ids: the step's host token ids, whose verify windows hold their anchor in the first row
    (the rows after it are placeholders); window_lens: every window's length (the verify windows
    first); drafts: [num verify windows, >= longest window - 1], on the drafter's device or the host.
    """
    count = drafts.shape[0]
    if count == 0:
        return
    cu = torch.zeros(count + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(window_lens[:count], dtype=torch.long), 0)
    rows = int(cu[-1])
    # One host-to-device copy for both the anchors and the window boundaries.
    meta = to_device(torch.cat([token_ids[cu[:-1]], cu]), out.device)
    cu_seqlens = meta[count:].to(torch.int32)  # the layout's own boundary dtype
    ops.pack_verify_tokens(meta[:count], to_device(drafts, out.device), cu_seqlens, rows, out=out[:rows])
