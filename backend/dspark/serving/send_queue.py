"""A send thread's queue of the Triton adapter (model_repository/dspark/1/model.py): requests with a
response to send, in order, except that first responses go ahead and paced ones wait until due."""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from typing import Any


class SendQueue:
    """One send thread's work, in order, except that requests yet to send their first response go
    ahead of the rest (time to first token), and paced requests wait until they are due."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._first: collections.deque = collections.deque()
        self._rest: collections.deque = collections.deque()
        self._later: list[tuple[float, int, Any]] = []  # (due, order, request): a heap
        self._order = itertools.count()

    def put(self, item: Any, first: bool = False) -> None:
        """Queue a request with a pending update, a single reply, or None (the end)."""
        with self._ready:
            (self._first if first else self._rest).append(item)
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
                if self._later and self._later[0][0] <= time.monotonic():
                    return heapq.heappop(self._later)[2]
                if self._rest:
                    return self._rest.popleft()
                self._ready.wait(self._later[0][0] - time.monotonic() if self._later else None)
