"""Live re-planning's clock in the simulator: drains, weight loads and the controller are looked
at (simulator/core/live_placement.py), and the next tick is scheduled while one is needed."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class LiveTickEvent(Event):
    PRIORITY = 45  # after this instant's arrivals (the meter has seen them), before engines decide
    __slots__ = ()

    def handle(self, sim) -> None:
        live = sim.cluster.live
        if live.tick(self.time):
            sim.loop.schedule(LiveTickEvent(self.time + live.tick_s))
