"""InStepDraft: a static-length step's drafts, made by the runner inside the target step.

With speculation `static`, a step's verify windows are known before anything is drafted, so the
target graphs' layout can be filled first and the draft block read its inputs from there
(`DSparkProposer.propose_in_step`): one copy of the step's windows to the device instead of one per
graph, and no host work between the block and the target forward. The runner calls `draft_into`
when the step replays a graph and `draft` when it runs eagerly; the engine reads `proposal` after.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from dspark.cuda_graphs import StaticLayout
from dspark.sequence import Sequence
from dspark.spec.proposer import DraftProposal, DSparkProposer
from dspark.verify_tokens import write_verify_tokens


class InStepDraft:
    """The drafts of one step's verify windows (a `cuda_graphs.StepDrafter`)."""

    def __init__(self, proposer: DSparkProposer, seqs: Seq[Sequence]) -> None:
        self.proposer = proposer
        self.seqs = seqs
        self.num_windows = len(seqs)
        # Set by whichever of draft_into / draft the runner calls.
        self.proposal: DraftProposal | None = None

    def draft_into(self, layout: StaticLayout, token_ids: torch.Tensor, window_lens: list[int]) -> None:
        """Draft from the filled `layout`, packing the drafts into its token ids (or, when the block
        cannot read the layout, draft apart and pack them the usual way)."""
        self.proposal = self.proposer.propose_in_step(self.seqs)
        if self.proposal is None:
            write_verify_tokens(token_ids, window_lens, self.draft(), layout.token_ids)

    def draft(self) -> torch.Tensor:
        """Draft apart (`DSparkProposer.propose`); the drafts, for the runner to pack."""
        self.proposal = self.proposer.propose(self.seqs)
        return self.proposal.tokens
