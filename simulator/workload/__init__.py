"""paraflex.simulator.workload: the requests a simulation replays.

`WorkloadSpec` (spec.py) says how; `generate` (generator.py) turns a spec, the models and a
total rate into a time-ordered list of `SimRequest`s, drawing every random number from one
seed: Zipf popularity (popularity.py), per-model arrival processes (arrivals.py: Poisson,
log-normal with a target CV, trace replay from trace.py) and lengths (lengths.py).
"""

from paraflex.simulator.workload.generator import SimRequest, generate
from paraflex.simulator.workload.spec import WorkloadSpec

__all__ = ["SimRequest", "WorkloadSpec", "generate"]
