"""What a long-lived dspark process tells Python's cyclic garbage collector about its heap."""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach (`gc.freeze`).

    Call it when a serving process (the engine process, a backend stub, a tensor-parallel rank) has
    built what it keeps for its life. The model, the tokenizer, the CUDA graphs and torch's modules are
    hundreds of thousands of objects, and every oldest-generation collection walks them all: on this
    project's CPU 54 ms with ~190k objects, once every few hundred steps, a stall in one step of the
    loop (each stream's inter-token gap) that can also mislead the speculation gate's step timing. Frozen
    objects are still freed by reference counting; a cycle among them that is dropped later stays until
    the process exits (bounded: such a process replaces nothing it built at start). The offline `LLM`
    does not call this: it lives in the user's process, whose heap is the user's."""
    gc.collect()
    gc.freeze()


def skip_exit_collection() -> None:
    """Let this process exit without the interpreter's garbage-collection passes over everything it
    holds: with torch loaded they were ~1 s of every exit on a 2-core host, and at a server's stop each
    backend stub, the engine process and each rank exit one after another. Call it last, when the
    process's work is done (its objects then live until the exit; the OS frees them)."""
    gc.freeze()


class CollectorPauses:
    """The cyclic garbage collector's passes in this process (any thread's: a pass holds the GIL, so
    the engine loop waits through it too): how many, how many of them over the oldest generation (which
    walks every tracked object), and their wall seconds. Counted by a `gc.callbacks` entry."""

    __slots__ = ("collections", "full_collections", "seconds", "_started")

    def __init__(self) -> None:
        self.collections = 0
        self.full_collections = 0
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        """gc's callback: at the start and the stop of every pass (passes never overlap)."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.collections += 1
        if info.get("generation") == 2:
            self.full_collections += 1


_PAUSES: list[CollectorPauses] = []  # this process's one counter, once asked for


def collector_pauses() -> CollectorPauses:
    """This process's collector pauses, counted from the first call on (a second call returns the
    same counter: one callback a process, however many engines)."""
    if not _PAUSES:
        _PAUSES.append(CollectorPauses())
        gc.callbacks.append(_PAUSES[0])
    return _PAUSES[0]
