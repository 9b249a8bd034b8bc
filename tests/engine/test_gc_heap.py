"""The serving processes' collector settings (engine/gc_heap.py): freezing keeps what exists
out of later collections, the switch turns it off, and the pause watch times collections."""

from __future__ import annotations

import gc

from paraflex.engine.gc_heap import PauseWatch, freeze_start_up_heap


def test_freeze_keeps_the_heap_out_of_collections_and_can_be_turned_off(monkeypatch):
    try:
        kept = [[i] for i in range(1000)]  # tracked containers alive at "start-up"
        frozen = freeze_start_up_heap()
        assert frozen is not None and frozen.objects >= len(kept) and frozen.full_collection_s >= 0
        assert "objects kept out of garbage collection" in frozen.describe()
        # frozen objects can still die (another test's thread dropping its last reference), never join
        assert len(kept) <= gc.get_freeze_count() <= frozen.objects
        monkeypatch.setenv("PARAFLEX_GC_FREEZE", "0")
        gc.unfreeze()
        assert freeze_start_up_heap() is None and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_pause_watch_counts_collections_and_reports_long_ones():
    lines = []
    watch = PauseWatch(report=lines.append, long_s=0.0)  # every collection is "long"
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        watch.stop()
    assert watch.collections[0] >= 1 and watch.collections[2] >= 1
    assert len(lines) == sum(watch.collections) and all("paused this process" in line for line in lines)
    assert "generation 2: " in watch.summary()
    gc.collect(2)  # stopped: no longer counted
    assert len(lines) == sum(watch.collections)
