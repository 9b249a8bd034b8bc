"""A point-to-point link between engines: the pipeline hop's latency + bytes / bandwidth.

Place in the data flow: the config's link (`ClusterConfig.interconnect`), or the hop `paraflex
profile` measured (paraflex/costs/serving_terms.py), priced by the cost model and the simulator
for every hop between stages (`paraflex.costs.costmodel` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interconnect:
    """A point-to-point link between engines (pipeline hops)."""

    bandwidth_Bps: float
    latency_s: float

    def transfer_time(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps
