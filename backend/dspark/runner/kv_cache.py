"""PagedKVCache: the key/value storage of one model's layers, addressed by pages of fixed size."""

from __future__ import annotations

import torch


class PagedKVCache:
    """Keys and values for `num_layers` layers: [num_layers, num_pages, page_size, num_kv_heads, head_dim].

    Allocated once at construction; the target and the drafter each own one, indexed by the same
    page table (a page id means the same token positions in both).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.num_pages = num_pages
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer: [num_pages, page_size, num_kv_heads, head_dim] each."""
        return self.k[index], self.v[index]
