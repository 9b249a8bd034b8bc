"""`plan(config, solver=...)`: the planner's one entry point, config in, `Placement` out.

Data flow: config -> `sharding.build_problem` (cost model, stage cuts) -> a solver
(`placement_optimizer.optimize` = paper Alg. 1 + 2, preferring replicas inside one node through
`node_aware.optimize_on_nodes`, `milp.solve` = exact, or a baseline from
`baselines`) -> `assemble.to_placement` -> checked by `validate.violations`. `paraflex plan`,
the simulator and the server call this.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from paraflex.errors import ParaflexError, UserError
from paraflex.placement import Placement
from paraflex.planner import baselines, milp
from paraflex.planner.assemble import to_placement
from paraflex.planner.node_aware import optimize_on_nodes
from paraflex.planner.sharding import build_problem
from paraflex.planner.validate import violations

BASELINES = {
    "dedicated": baselines.dedicated,
    "shared": baselines.shared,
    "grouped": baselines.grouped,
    "tensor": baselines.tensor,
}
SOLVERS = ("paraflex", "milp", *BASELINES)

Progress = Callable[[int, int, float], None]


def plan(
    config,
    solver: str = "paraflex",
    time_limit: float | None = None,
    progress: Progress | None = None,
    cost_model=None,
    rates: Mapping[str, float] | None = None,
    cuts: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Placement:
    """Plan `config` with `solver`; raises UserError when no feasible plan exists. `rates`
    (model -> rate > 0) replace the config's model rates (re-planning for measured traffic);
    `cuts` (model -> its stages' layer ranges) fix those models' stage cuts (live re-planning
    keeps the serving cuts: a live change cannot re-cut a model)."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    problem, facts = build_problem(config, cost_model)
    if rates is not None:
        problem = problem.with_rates(rates)
    if cuts is not None:
        problem = problem.with_cuts(cuts)
    params = {"device": config.cluster.device, "tp": config.cluster.tp, "devices_per_engine": 1, **facts}
    if config.cluster.nodes:  # engines per node: `paraflex serve` packs each node's engines on one Ray node
        params["nodes"] = list(config.cluster.nodes)
    if solver == "paraflex":
        laid_out, solution = problem, optimize_on_nodes(problem, progress, fill=config.planner.fill_engines)
    elif solver == "milp":
        params["time_limit_s"] = time_limit
        laid_out, solution = problem, milp.solve(problem, time_limit, progress, fill=config.planner.fill_engines)
    else:
        laid_out, solution = BASELINES[solver](problem)
        if solver == "tensor":
            params["devices_per_engine"] = problem.num_engines
            params["tp"] = config.cluster.tp * problem.num_engines
    placement = to_placement(laid_out, solution, solver, params)
    problems = violations(placement, config)
    if problems and solver in ("paraflex", "milp"):
        raise ParaflexError(f"planner produced an invalid plan: {problems[0]}")
    overflow = [p for p in problems if p.startswith("(5)")]
    if overflow:
        raise UserError(f"the {solver} layout does not fit this cluster: {overflow[0]}")
    return placement
