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
        num_tokens: int = 0,
        num_requests: int = 0,
    ) -> AttentionBatch:
        """Lay out windows: request r's window covers positions [window_starts[r], +window_lens[r]).

        pages[r] lists request r's cache pages in order; a window's keys are every position before
        its end. num_tokens / num_requests (0: exact) pad the layout to a fixed size, as a captured
        step needs: padding tokens get slot -1 (never stored), padding windows are empty with no keys.
        Vectorised: a handful of tensor ops whatever the number of requests.
        """
        count = len(window_lens)
        lens = torch.tensor(window_lens, dtype=torch.int64)
        starts = torch.tensor(window_starts, dtype=torch.int64)
        total = int(lens.sum())
        num_tokens = max(num_tokens, total)
        num_requests = max(num_requests, count)
        page_counts = torch.tensor([len(p) for p in pages], dtype=torch.int64)
        max_pages = max(int(page_counts.max()) if count else 1, 1)
        table = torch.zeros(num_requests, max_pages, dtype=torch.int32)
        flat_pages = torch.tensor([page for p in pages for page in p], dtype=torch.int32)
        if flat_pages.numel():
            rows = torch.repeat_interleave(torch.arange(count), page_counts)
            first = torch.cumsum(page_counts, 0) - page_counts
            cols = torch.arange(flat_pages.numel()) - torch.repeat_interleave(first, page_counts)
            table[rows, cols] = flat_pages
        cu = torch.zeros(num_requests + 1, dtype=torch.int32)
        cu[1 : count + 1] = torch.cumsum(lens, 0).to(torch.int32)
        cu[count + 1 :] = total
        kv_lens = torch.zeros(num_requests, dtype=torch.int32)
        kv_lens[:count] = (starts + lens).to(torch.int32)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        if total:
            owner = torch.repeat_interleave(torch.arange(count), lens)
            positions = torch.arange(total) - (cu[:count].long())[owner] + starts[owner]
            slots[:total] = table[owner, positions // page_size].long() * page_size + positions % page_size
        return cls(cu.to(device), kv_lens.to(device), table.to(device), slots.to(device), causal)
