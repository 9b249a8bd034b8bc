"""A client request reaches the gateway: dispatch it to a replica's first-stage engine."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class RequestArrivalEvent(Event):
    PRIORITY = 40
    __slots__ = ("request",)

    def __init__(self, time: float, request):
        super().__init__(time)
        self.request = request

    def handle(self, sim) -> None:
        sim.cluster.admit(self.request, self.time)
