"""The seed clusters' one event type: at `time`, call a cluster method with its arguments.

The seed clusters (aegaeon_cluster.py, colocated_cluster.py) schedule their instants (an
execution ends, a model finishes loading, KV reaches host memory) as `SeedEvent`s on the
simulator's event loop; ties break by insertion order (after request arrivals at the same
instant, PRIORITY 45 > 40), so runs are deterministic.
"""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class SeedEvent(Event):
    PRIORITY = 45
    __slots__ = ("call", "args")

    def __init__(self, time: float, call, *args):
        super().__init__(time)
        self.call = call
        self.args = args

    def handle(self, sim) -> None:
        self.call(*self.args, self.time)
