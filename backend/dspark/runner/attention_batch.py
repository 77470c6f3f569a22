"""AttentionBatch: the per-step layout of packed ragged windows over paged KV caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.kernels import ops, reference
from dspark.runner.deferred_inputs import DeferredInputs
from dspark.runner.host_to_device import to_device


@dataclass
class AttentionBatch:
    """Where each packed token's keys go and which keys each window sees.

    cu_seqlens_q: [R + 1] int32 window boundaries in the packed tokens; kv_lens: [R] int32 keys per
    request including its window; page_table: [R, max_pages] int32; slots: [num_tokens] int64 cache
    slot of each packed token; causal: windows causal (target) or fully visible (draft block);
    positions: [num_tokens] int64 each packed token's position, when the layout was built here (a
    captured step's layout keeps its own); host_windows: on a CPU, the layout once more as every layer
    reads it there (`reference.host_windows`; None for a padded or deferred layout and on a GPU);
    host_rotation: with host_windows, the rotary multipliers of `positions` from the table `build` was
    given (`reference.host_rotation`), which every layer rotating by that table reads.
    """

    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    slots: torch.Tensor
    causal: bool
    positions: torch.Tensor | None = None
    host_windows: reference.HostWindows | None = None
    host_rotation: reference.HostRotation | None = None

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
        token_ids: torch.Tensor | None = None,
        deferred: DeferredInputs | None = None,
        rotary_table: torch.Tensor | None = None,
    ) -> AttentionBatch:
        """Lay out windows: request r's window covers positions [window_starts[r], +window_lens[r]).

        pages[r] lists request r's cache pages in order; a window's keys are every position before
        its end. num_tokens / num_requests (0: exact) pad the layout to a fixed size, as a captured
        step needs: padding tokens get slot -1 (never stored), padding windows are empty with no keys.
        The page table is built on the host; slots, boundaries and key counts on `device`
        (`ops.build_window_layout`: the layout kernel on a GPU). `deferred`: what the windows take from
        an earlier step not yet accepted, applied to the device copy of the starts and to `token_ids`
        (the step's token ids on `device`) before the layout is computed. `rotary_table`: the cos/sin
        table of the model this layout is for (a CPU layout then carries its rotary multipliers).
        """
        count = len(window_lens)
        num_requests = max(num_requests, count)
        starts = torch.zeros(num_requests, dtype=torch.int64)
        lens = torch.zeros(num_requests, dtype=torch.int64)
        starts[:count] = torch.tensor(window_starts, dtype=torch.int64)
        lens[:count] = torch.tensor(window_lens, dtype=torch.int64)
        window_tokens = int(lens.sum())
        num_tokens = max(num_tokens, window_tokens)
        table = to_device(build_page_table(pages, num_requests), device)
        bounds = to_device(torch.stack([starts, lens]), device)
        if deferred is not None:
            assert token_ids is not None, "a deferred step's token ids take their anchors here"
            deferred.apply(token_ids, bounds[0])
        positions, slots, cu, kv_lens = ops.build_window_layout(
            bounds[0], bounds[1], table, page_size, num_tokens
        )
        host_windows = None
        unpadded = num_requests == count and num_tokens == window_tokens
        if device.type == "cpu" and count and unpadded and deferred is None and min(window_lens) > 0:
            host_windows = reference.host_windows(
                pages, window_starts, window_lens, page_size, causal, device
            )
        rotation = None
        if host_windows is not None and rotary_table is not None:
            rotation = reference.host_rotation(positions, rotary_table)
        return cls(cu, kv_lens, table, slots, causal, positions, host_windows, rotation)


def build_page_table(pages: Sequence[Sequence[int]], num_rows: int) -> torch.Tensor:
    """[num_rows, max pages] int32 on the host: row r lists pages[r] in order (zeros past its end and
    in rows past len(pages))."""
    table = np.zeros((max(num_rows, len(pages)), page_table_width(pages)), dtype=np.int32)
    write_page_rows(table, pages)
    return torch.from_numpy(table)


def page_table_width(pages: Sequence[Sequence[int]]) -> int:
    """Columns of a page table of these rows: the longest row's pages, at least one."""
    return max(max(map(len, pages), default=1), 1)


def write_page_rows(table: np.ndarray, pages: Sequence[Sequence[int]]) -> None:
    """Write row r of a zeroed int32 `table` with pages[r]. Row by row into numpy: at the batch sizes
    a step has, that beats both torch.tensor over padded lists (on the 2-core CPU, 64 requests of 1-12
    pages: 30 against 58-84 µs; 256: 126-177 against 240-255; one: 3-5 against 6) and a vectorised
    scatter."""
    for row, request_pages in zip(table, pages, strict=False):
        row[: len(request_pages)] = request_pages
