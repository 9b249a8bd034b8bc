"""The serving processes' garbage collector: the start-up heap kept out of collections, and the
long pauses that remain reported.

Place in the data flow: `paraflex serve` (paraflex/commands/serve.py) calls `freeze_start_up_heap`
once the engines are built and warmed up (paraflex/serving/warm_up.py), just before the socket
opens, and each Ray engine actor (engine/ray_engine.py) once its engine is built; the serve
command then keeps a `PauseWatch` on its process until it stops.

Why: CPython's full (generation 2) collection walks every tracked object, and a serving process
holds hundreds of thousands after start-up (torch, Triton, transformers, tokenizers, the HTTP
stack) that live until it exits; a collection pauses every thread of the process. In the
in-process GPU server on an H100 host (three models, 222k objects) a full collection took 116 ms
(83 ms on the 2-core VM with toy models); after `gc.freeze()`, which moves the start-up objects to
the permanent generation that collections skip, 19 ms, and a whole served fidelity run
(bench/sim_fidelity.py, ~2,400 requests) then saw 3 full collections, the longest pause 30 ms.
vLLM and SGLang freeze after start-up too. `PARAFLEX_GC_FREEZE=0` turns it off (the ablation).
(The 0.5-1.7 s engine stalls first suspected to be collections were kernel compiles:
bench/first_prefills.py.)
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import time
from dataclasses import dataclass

LONG_PAUSE_S = 0.05  # a collection at least this long is reported as it happens
REPORT_EVERY_S = 1.0


@dataclass(frozen=True)
class Frozen:
    """What `freeze_start_up_heap` did: objects frozen, and a full collection's time before
    and after (the pause a generation-2 collection costs this process)."""

    objects: int
    full_collection_s: float
    after_s: float

    def describe(self) -> str:
        return (f"start-up heap: {self.objects} objects kept out of garbage collection (a full collection "
                f"took {1000 * self.full_collection_s:.0f} ms, now {1000 * self.after_s:.1f} ms)")


def freeze_start_up_heap() -> Frozen | None:
    """Collect once, then keep every object alive now out of later collections (None where
    PARAFLEX_GC_FREEZE=0: nothing done)."""
    if os.environ.get("PARAFLEX_GC_FREEZE", "1") == "0":
        return None
    start = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - start
    gc.freeze()
    start = time.perf_counter()
    gc.collect()
    return Frozen(gc.get_freeze_count(), full, time.perf_counter() - start)


class PauseWatch:
    """Times every collection of this process (`gc.callbacks`): totals per generation, and
    `report(line)` for each one of at least `long_s`, from a reporter thread within
    `REPORT_EVERY_S` (the callback itself does no I/O: it may run inside a write to the very
    stream the report goes to)."""

    def __init__(self, report, long_s: float = LONG_PAUSE_S) -> None:
        self.report, self.long_s = report, long_s
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._started: dict[int, float] = {}  # thread id -> when its collection started
        self._long: collections.deque[str] = collections.deque()  # lines for the reporter
        self._stopped = threading.Event()
        gc.callbacks.append(self._on_gc)
        self._reporter = threading.Thread(target=self._report_loop, name="pf-gc-report", daemon=True)
        self._reporter.start()

    def _on_gc(self, phase: str, info: dict) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        began = self._started.pop(thread, None)
        if began is None:
            return
        took, gen = now - began, info["generation"]
        self.collections[gen] += 1
        self.seconds[gen] += took
        self.longest = max(self.longest, took)
        if took >= self.long_s:
            self._long.append(f"warning: a garbage collection (generation {gen}, {info['collected']} objects "
                              f"freed) paused this process {1000 * took:.0f} ms")

    def _report_loop(self) -> None:
        while not self._stopped.wait(REPORT_EVERY_S):
            self._flush()

    def _flush(self) -> None:
        while self._long:
            self.report(self._long.popleft())

    def summary(self) -> str:
        parts = ", ".join(f"generation {g}: {n} in {s:.2f} s" for g, (n, s) in enumerate(zip(self.collections,
                                                                                               self.seconds)))
        return f"garbage collections: {parts}; longest {1000 * self.longest:.0f} ms"

    def stop(self) -> None:
        """No more timing; the long pauses not yet reported are reported now."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stopped.set()
        self._reporter.join()
        self._flush()
