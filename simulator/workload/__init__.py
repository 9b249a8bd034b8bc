"""paraflex.simulator.workload: the requests a simulation replays.

`generate` (generator.py) turns the config's workload section (paraflex.config.schema.WorkloadConfig:
arrival process, CV, trace, Zipf popularity, scaling), the served models and a total rate into
a time-ordered list of `SimRequest`s, drawing every random number from one seed: per-model
arrival processes (arrivals.py: Poisson, log-normal with a target CV, trace replay from
trace.py) and token counts (lengths.py).
"""

from paraflex.simulator.workload.generator import SimRequest, WorkloadModel, generate, workload_of

__all__ = ["SimRequest", "WorkloadModel", "generate", "workload_of"]
