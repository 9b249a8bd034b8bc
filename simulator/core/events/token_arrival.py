"""New tokens (metadata only) travel from a model's last stage back to its first stage,
where the requests become ready for their next decode step."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class TokenArrivalEvent(Event):
    PRIORITY = 30
    __slots__ = ("engine", "message")

    def __init__(self, time: float, engine, message):
        super().__init__(time)
        self.engine = engine
        self.message = message

    def handle(self, sim) -> None:
        if self.message is None:  # taken over by the joint replay
            return
        sim.cluster.deliver_tokens(self.engine, self.message, self.time)
