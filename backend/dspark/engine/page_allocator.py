"""PageAllocator: hands out KV-cache pages to sequences and takes them back."""

from __future__ import annotations

from collections import deque

from dspark.sequence import Sequence


class PageAllocator:
    """A free list of page ids; a sequence owns the pages listed in `seq.pages`, in position order."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_used(self) -> int:
        """Pages held by sequences."""
        return self.num_pages - len(self._free)

    def pages_needed(self, seq: Sequence, num_positions: int) -> int:
        """Extra pages `seq` needs to hold `num_positions` cache positions."""
        return max(-(-num_positions // self.page_size) - len(seq.pages), 0)

    def try_reserve(self, seq: Sequence, num_positions: int) -> bool:
        """Grow `seq` to hold `num_positions` positions; False (and no change) when pages run out."""
        needed = self.pages_needed(seq, num_positions)
        if needed > len(self._free):
            return False
        seq.pages.extend(self._free.popleft() for _ in range(needed))
        return True

    def release(self, seq: Sequence) -> None:
        """Return every page of `seq` to the free list."""
        self._free.extend(seq.pages)
        seq.pages.clear()
