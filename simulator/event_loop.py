"""The discrete-event core: a heap of typed events ordered by (time, priority, sequence).

`Simulation` (runner.py) pushes the arrival events, then calls `EventLoop.run`; each event's
`handle(sim)` may schedule further events through `EventLoop.schedule`. Ties at one instant
break first by the event type's `PRIORITY` (see events/) and then by insertion order, so a run
is a pure function of its inputs and seed. After each event the cluster settles the engines it
woke (`Cluster.settle`): at once when nothing else happens at that instant, else through
wake-up events that run after everything else at that instant.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paraflex.simulator.events.base import Event


class EventLoop:
    """Pops events in time order and hands them to their handler; counts what it did."""

    def __init__(self):
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def schedule(self, event: "Event") -> None:
        if event.time < self.now:
            raise ValueError(f"event {type(event).__name__} scheduled in the past ({event.time} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.PRIORITY, self._seq, event))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, sim: Any, until: float = float("inf")) -> None:
        heap = self._heap
        pop = heapq.heappop
        cluster = sim.cluster
        while heap and heap[0][0] <= until:
            time, _, _, event = pop(heap)
            self.now = time
            self.processed += 1
            event.handle(sim)
            if cluster.woken:
                cluster.settle(time, bool(heap) and heap[0][0] <= time)
