"""AttentionBatch: the per-step layout of packed ragged windows over paged KV caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """Where each packed token's keys go and which keys each window sees.

    cu_seqlens_q: [R + 1] int32 window boundaries in the packed tokens; kv_lens: [R] int32 keys per
    request including its window; page_table: [R, max_pages] int32; slots: [num_tokens] int64 cache
    slot of each packed token; causal: windows causal (target) or fully visible (draft block).
    """

    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    slots: torch.Tensor
    causal: bool

    @property
    def num_requests(self) -> int:
        """R, the number of windows."""
        return self.kv_lens.shape[0]

    @classmethod
    def build(
        cls,
        pages: Sequence[Sequence[int]],
        window_starts: Sequence[int],
        window_lens: Sequence[int],
        page_size: int,
        causal: bool,
        device: torch.device,
    ) -> AttentionBatch:
        """Lay out windows: request r's window covers positions [window_starts[r], +window_lens[r]).

        pages[r] lists request r's cache pages in order; a window's keys are every position before
        its end.
        """
        num_requests = len(window_lens)
        max_pages = max((len(p) for p in pages), default=1) or 1
        table = torch.zeros(num_requests, max_pages, dtype=torch.int32)
        slot_list: list[torch.Tensor] = []
        for r, page_ids in enumerate(pages):
            table[r, : len(page_ids)] = torch.tensor(page_ids, dtype=torch.int32)
            positions = torch.arange(window_starts[r], window_starts[r] + window_lens[r])
            slot_list.append(table[r, positions // page_size].long() * page_size + positions % page_size)
        cu = torch.zeros(num_requests + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(window_lens, dtype=torch.int32), 0)
        kv_lens = torch.tensor(
            [s + n for s, n in zip(window_starts, window_lens, strict=True)], dtype=torch.int32
        )
        slots = torch.cat(slot_list) if slot_list else torch.zeros(0, dtype=torch.long)
        return cls(cu.to(device), kv_lens.to(device), table.to(device), slots.to(device), causal)
