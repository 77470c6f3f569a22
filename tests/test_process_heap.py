"""dspark.process_heap: the startup heap frozen from the collector, and the collector's passes counted
into the engine loop's totals (`LoopTotals.gc_*`)."""

from __future__ import annotations

import gc

from dspark.engine.step_timer import LoopCounters
from dspark.process_heap import collector_pauses, freeze_startup_heap


def test_collector_passes_are_counted_once_a_process_and_by_generation() -> None:
    pauses = collector_pauses()
    assert collector_pauses() is pauses  # one callback a process
    assert gc.callbacks.count(pauses) == 1
    before = (pauses.collections, pauses.full_collections, pauses.seconds)
    gc.collect(0)
    gc.collect()
    assert pauses.collections == before[0] + 2
    assert pauses.full_collections == before[1] + 1  # only the second walked the oldest generation
    assert pauses.seconds > before[2]


def test_the_loop_totals_count_the_passes_since_the_engine_started() -> None:
    gc.collect()  # before the counters: not theirs
    counters = LoopCounters()
    assert counters.totals().gc_collections == counters.totals().gc_full_collections == 0
    gc.collect()
    gc.collect()
    totals = counters.totals()
    assert totals.gc_full_collections == 2 and totals.gc_collections >= 2 and totals.gc_seconds > 0


def test_a_frozen_startup_heap_is_out_of_the_collectors_reach() -> None:
    """What the process holds when it freezes is not walked again: a full pass after it tracks only what
    came later (here, nothing but a few new objects)."""
    kept = [[i] for i in range(20_000)]  # a startup heap's worth of tracked objects
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert len(gc.get_objects()) < len(kept)  # the tracked generations hold only what came after
    finally:
        gc.unfreeze()
    assert len(gc.get_objects()) >= len(kept)
