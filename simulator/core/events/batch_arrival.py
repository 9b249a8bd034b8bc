"""A batch's hidden and residual states finish their hop to the next stage's engine."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class BatchArrivalEvent(Event):
    PRIORITY = 20
    __slots__ = ("engine", "message")

    def __init__(self, time: float, engine, message):
        super().__init__(time)
        self.engine = engine
        self.message = message

    def handle(self, sim) -> None:
        if self.message is None:  # taken over by the joint replay
            return
        sim.cluster.deliver_batch(self.engine, self.message, self.time)
