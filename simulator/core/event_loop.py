"""The discrete-event core: a heap of typed events ordered by (time, priority, sequence).

`Simulation` (runner.py) pushes the arrival events, then calls `EventLoop.run`; each event's
`handle(sim)` may schedule further events through `EventLoop.schedule`. Ties at one instant
break first by the event type's `PRIORITY` (see events/) and then by insertion order, so a run
is a pure function of its inputs and seed. After each event the cluster settles the engines it
woke (`Cluster.settle`): at once when nothing else happens at that instant, else through
wake-up events that run after everything else at that instant.

Fast path: those wake-up events (a third of all events) skip the heap. They always fall at the
current instant with the highest priority, so `schedule_last` keeps them in a FIFO that runs
once no heap event remains at that instant: the order of the heap, without its cost
(tests/simulator/test_sim_event_loop.py pins equality with the all-heap loop).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paraflex.simulator.core.events.base import Event


class EventLoop:
    """Pops events in time order and hands them to their handler; counts what it did."""

    def __init__(self):
        self._heap: list[tuple[float, int, int, Event]] = []
        self._last: deque[Event] = deque()  # events at `now` that run after every heap event at `now`
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def schedule(self, event: "Event") -> None:
        if event.time < self.now:
            raise ValueError(f"event {type(event).__name__} scheduled in the past ({event.time} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.PRIORITY, self._seq, event))

    def schedule_last(self, event: "Event") -> None:
        """Schedule an event of the highest priority at the current instant (engine wake-ups):
        it runs after every other event at this instant, in the order given."""
        if event.time != self.now:
            raise ValueError(f"event {type(event).__name__} at {event.time} is not at the current instant {self.now}")
        self._last.append(event)

    def next_time(self) -> float:
        """Time of the next event (inf when none is left)."""
        if self._last:
            return self.now
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap) + len(self._last)

    def run(self, sim: Any, until: float = float("inf")) -> None:
        heap = self._heap
        last = self._last
        pop = heapq.heappop
        cluster = sim.cluster
        while True:
            if heap and heap[0][0] <= (self.now if last else until):
                time, _, _, event = pop(heap)
                self.now = time
            elif last:
                event = last.popleft()
                time = self.now
            else:
                return
            self.processed += 1
            event.handle(sim)
            if cluster.woken:
                cluster.settle(time, bool(last) or (bool(heap) and heap[0][0] <= time))
