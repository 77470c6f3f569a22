"""A send thread's queue of the Triton adapter (model_repository/dspark/1/model.py): requests with a
response to send, in order, except that first responses, then final ones, go ahead and paced ones wait
until due."""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from typing import Any


class SendQueue:
    """One send thread's work, in order, except that requests with their first response to send go
    first (the time to first token), then those with their final one (a closed-loop client sends its
    next request when it arrives), and paced requests wait until they are due, then go before the
    rest."""

    # What a queued request has to send: the order of `take`.
    FIRST, FINAL, REST = 0, 1, 2

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._first: collections.deque = collections.deque()
        self._final: collections.deque = collections.deque()
        self._rest: collections.deque = collections.deque()
        self._later: list[tuple[float, int, Any]] = []  # (due, order, request): a heap
        self._order = itertools.count()

    def put(self, item: Any, kind: int = REST) -> None:
        """Queue a request with a pending update (`kind`: its first response, its final one, or another),
        a single reply, or None (the end)."""
        with self._ready:
            (self._first, self._final, self._rest)[kind].append(item)
            self._ready.notify()

    def put_later(self, item: Any, due: float) -> None:
        """Queue a request with a pending update, to be taken at `due` (time.monotonic()) or after."""
        with self._ready:
            heapq.heappush(self._later, (due, next(self._order), item))
            if self._later[0][2] is item:  # the earliest now: a waiting take() must wait less
                self._ready.notify()

    def take(self) -> Any:
        """The next item, waiting for one."""
        with self._ready:
            while True:
                if self._first:
                    return self._first.popleft()
                if self._final:
                    return self._final.popleft()
                if self._later and self._later[0][0] <= time.monotonic():
                    return heapq.heappop(self._later)[2]
                if self._rest:
                    return self._rest.popleft()
                self._ready.wait(self._later[0][0] - time.monotonic() if self._later else None)
