"""An idle engine with new work asks its scheduler for the next batch (once per instant)."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class EngineWakeupEvent(Event):
    PRIORITY = 90
    __slots__ = ("engine",)

    def __init__(self, time: float, engine):
        super().__init__(time)
        self.engine = engine

    def handle(self, sim) -> None:
        sim.cluster.wakeup(self.engine, self.time)
