"""ParaFlex: serve many heterogeneous LLMs on one shared accelerator pool.

Data flow: config -> `paraflex.planner` (placement JSON) -> `paraflex.engine` engines
(serve) or `paraflex.simulator` (simulate). This package holds the user-facing face:
CLI, config schema, model catalog, cost model, placement file and gateway.
"""

__version__ = "0.1.0"
