"""paraflex.planner: sharding, replication (Alg. 1), DRF placement (Alg. 2), exact MILP and
baseline layouts. Input: models' stage counts, weights and demand; output: a `Placement`.
Pure Python + numpy (pulp for the exact solver): no torch, Ray or HTTP imports.

Entry point: `paraflex.planner.plan(config, solver=...)` (see `api`).
"""

from paraflex.planner.api import SOLVERS, plan

__all__ = ["plan", "SOLVERS"]
