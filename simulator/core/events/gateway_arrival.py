"""A client request reaches the gateway of a shared host CPU (paraflex/costs/host_cpu.py): the
gateway's work for it takes its quiet latency stretched by the host's demand now, so the
request reaches the engines (a `RequestArrivalEvent`) that much later, after the constant
frontend path the runner already added to its arrival."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event
from paraflex.simulator.core.events.request_arrival import RequestArrivalEvent


class GatewayArrivalEvent(Event):
    PRIORITY = 40
    __slots__ = ("request",)

    def __init__(self, time: float, request):
        super().__init__(time)
        self.request = request

    def handle(self, sim) -> None:
        sim.loop.schedule(RequestArrivalEvent(self.request.arrival + sim.cluster.gateway_delay_s(self.time), self.request))
