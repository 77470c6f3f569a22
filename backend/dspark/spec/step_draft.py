"""InStepDrafts: a step's drafts that the runner makes inside the target step.

When verify lengths do not depend on the drafts (`VerifyPolicy.drafts_in_step`: speculation
`static`), a step's verify windows are known before anything is drafted, so the target graphs' layout
can be filled first and the draft block read its inputs from there
(`DSparkProposer.propose_in_step`): one copy of the step's windows to the device instead of one per
graph, and no host work between the block and the target forward. The plan carries this value in
place of the drafts; the runner drafts when it packs the step's token ids (`pack`, a `VerifyDrafts`)
and hands the drafts back in its result (`TargetResult.drafts`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from dspark.runner.verify_tokens import write_verify_tokens
from dspark.sequence import Sequence
from dspark.spec.drafts import Drafts
from dspark.spec.proposer import DSparkProposer


@dataclass(frozen=True)
class InStepDrafts:
    """The drafts of one step's verify windows (one per request of `seqs`), still to be made."""

    proposer: DSparkProposer
    seqs: Seq[Sequence]

    @property
    def num_windows(self) -> int:
        """The verify windows drafted (the step's first ones)."""
        return len(self.seqs)

    def pack(
        self, token_ids: torch.Tensor, window_lens: list[int], out: torch.Tensor, in_layout: bool
    ) -> Drafts:
        """Draft and pack the drafts into `out` (`VerifyDrafts.pack`): from the filled target layout
        when `in_layout` and the block can read it, else apart (`DSparkProposer.propose`) and packed the
        usual way (the drafter's blocks: no copies, `spec.lookup`). Returns the drafts."""
        drafts = self.proposer.propose_in_step(self.seqs) if in_layout else None
        if drafts is None:
            # The windows were laid out before drafting: whole drafter blocks, no copies (a copy may be
            # shorter than its window).
            drafts = self.proposer.propose(self.seqs, copies=False)
            write_verify_tokens(token_ids, window_lens, drafts.tokens, out)
        return drafts
