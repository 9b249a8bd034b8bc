"""Exact solver (`--solver milp`): the placement of Alg. 2 solved to optimality with pulp/CBC.

Same problem, same replication schedule: replica counts come from Alg. 1 (demand
proportionality, eq. 7, one replica added per step) and every step's placement is solved
exactly instead of greedily; replication stops when a step has no feasible placement (or
Alg. 1 returns -1) and the last feasible plan is returned. `bench/planner_quality.py` compares
the heuristic with it.

MILP for fixed replica counts r_i, all quantities in units of the engine memory M:
  x[i,p] in {0,1}       a replica of model i starts at engine p (P1: stage k on p + k, mod N on
                        a ring); sum_p x[i,p] = r_i
  y[i,e] = sum of x[i,p] over starts whose window covers e;  y[i,e] <= 1        (4)
  C_e = 1 - sum_{i,p} w[i, e - p] x[i,p]                                      (1), (5)
  0 <= a[i,e] <= y[i,e];  sum_i a[i,e] <= C_e                  KV granted to the stage of i on e
  t <= a[i,e] + 1 - y[i,e]  for all i, e;  t >= kappa                         (6)
  maximise t
The LP part is DRF's first water level (max-min per-stage KV): for a fixed placement its
optimum is min_e C_e / n_e, the Phi* that Alg. 2 maximises greedily (see `drf`).

Size: sum_i |starts_i| binaries plus N_m * N_e continuous variables. CBC proves optimality
in well under a second up to about 8 engines x 5 models, in seconds at 16 x 8; beyond that use
the heuristic (or pass a time limit and accept an unproven incumbent, reported as such).
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

from paraflex.errors import UserError
from paraflex.planner.problem import NoFeasiblePlan, Problem, Solution, replica_engines
from paraflex.planner.replication import choose_next, replica_work

Progress = Callable[[int, int, float], None]


def _starts(problem: Problem, s: int) -> range:
    return range(problem.num_engines if problem.ring else problem.num_engines - s + 1)


def solve_placement(problem: Problem, replicas: list[int], time_limit: float | None = None,
                    stage_cap: int | None = None):
    """Optimal placement for fixed replica counts: (engine lists per model, Phi* bytes, proven).
    `stage_cap`: at most that many stages on any engine (the fill phase, as the heuristic's).

    Returns None when no placement is feasible, or when the time limit passed with no
    feasible placement found.
    """
    with warnings.catch_warnings():  # PuLP 3.x announces its 4.0 API; the 2.7+ API used here works
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_placement(problem, replicas, time_limit, stage_cap)


def _solve_placement(problem: Problem, replicas: list[int], time_limit: float | None, stage_cap: int | None = None):
    try:  # imported here: the rest of ParaFlex (serving in process, the heuristic planner) runs without it
        import pulp
    except ImportError:
        raise UserError("--solver milp needs the 'pulp' package (pip install pulp); "
                        "the default paraflex solver does not") from None
    n = problem.num_engines
    mem = float(problem.memory_bytes)
    lp = pulp.LpProblem("paraflex_placement", pulp.LpMaximize)
    t = pulp.LpVariable("t", lowBound=problem.kappa_bytes / mem, upBound=1.0)
    x, cover, weight_on = {}, {}, {e: [] for e in range(n)}
    for i, m in enumerate(problem.models):
        s = m.num_stages
        for p in _starts(problem, s):
            x[i, p] = pulp.LpVariable(f"x_{i}_{p}", cat="Binary")
            for k, e in enumerate(replica_engines(p, s, n)):
                cover.setdefault((i, e), []).append(x[i, p])
                weight_on[e].append((m.stage_weights[k] / mem, x[i, p]))
        lp += pulp.lpSum(x[i, p] for p in _starts(problem, s)) == replicas[i], f"replicas_{i}"
    lp += t
    grants = {e: [] for e in range(n)}
    if stage_cap is not None:
        for e in range(n):
            on = [v for (i, ee), xs in cover.items() if ee == e for v in xs]
            if on:
                lp += pulp.lpSum(on) <= stage_cap, f"stage_cap_{e}"
    for (i, e), xs in cover.items():
        y = pulp.lpSum(xs)
        a = pulp.LpVariable(f"a_{i}_{e}", lowBound=0.0, upBound=1.0)
        grants[e].append(a)
        lp += y <= 1, f"no_overlap_{i}_{e}"
        lp += a <= y, f"grant_only_if_resident_{i}_{e}"
        lp += t <= a + 1 - y, f"min_share_{i}_{e}"
    for e in range(n):
        if grants[e]:
            lp += pulp.lpSum(grants[e]) + pulp.lpSum(w * v for w, v in weight_on[e]) <= 1.0, f"memory_{e}"
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    lp.solve(solver)
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    engines = []
    for i, m in enumerate(problem.models):
        starts = [p for p in _starts(problem, m.num_stages) if x[i, p].value() > 0.5]
        engines.append([replica_engines(p, m.num_stages, n) for p in starts])
    return engines, _phi_bytes(problem, engines), lp.sol_status == pulp.LpSolutionOptimal


def _phi_bytes(problem: Problem, engines: list[list[list[int]]]) -> float:
    """Phi* of a placement recomputed exactly from the chosen engines (no solver tolerance)."""
    cap = [float(problem.memory_bytes)] * problem.num_engines
    cnt = [0] * problem.num_engines
    for m, reps in zip(problem.models, engines):
        for rep in reps:
            for k, e in enumerate(rep):
                cap[e] -= m.stage_weights[k]
                cnt[e] += 1
    return min(c / k for c, k in zip(cap, cnt) if k)


def _max_stages(problem: Problem, engines: list[list[list[int]]]) -> int:
    cnt = [0] * problem.num_engines
    for reps in engines:
        for rep in reps:
            for e in rep:
                cnt[e] += 1
    return max(cnt)


def solve(problem: Problem, time_limit: float | None = None, progress: Progress | None = None,
          fill: bool = True) -> Solution:
    """Alg. 1's replication schedule with every step's placement solved exactly. With `fill`
    (as `placement_optimizer.optimize`) a model that cannot get another replica drops out and
    the others go on."""
    deadline = None if time_limit is None else time.monotonic() + time_limit
    stages, ratios, work = problem.stage_counts, problem.ratios, replica_work(problem)
    replicas = [1] * len(problem.models)
    last: Solution | None = None
    iteration = 0
    added = -1
    full: dict[int, str] = {}
    cap = None  # fill phase: stages per engine at most the busiest engine's when the paper's rule stopped
    while True:
        iteration += 1
        remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
        found = solve_placement(problem, replicas, remaining, cap)
        if found is None:
            if last is None:
                raise NoFeasiblePlan(
                    "no feasible placement of one replica per model (MILP): lower planner.kappa_gb, "
                    "add engines or memory, or lower planner.target_stage_time so models are cut into more, "
                    "smaller stages that pack together"
                )
            reason = f"no feasible placement with {sum(replicas)} replicas {replicas}"
            if not fill:
                last.stop_reason = reason
                return last
            replicas[added] -= 1
            full[added] = reason
            if cap is None:
                cap = _max_stages(problem, last.replicas)
            added = choose_next(problem.num_engines, stages, replicas, ratios, fill=True, skip=full, work=work)
            if added < 0:
                last.stop_reason = "no model can get another replica (" + "; ".join(
                    f"{problem.models[i].name}: {why}" for i, why in full.items()) + "; the others need more engines)"
                return last
            replicas[added] += 1
            iteration -= 1
            continue
        engines, phi, proven = found
        last = Solution(engines, phi, iteration, optimal=proven)
        if progress:
            progress(iteration, sum(replicas), phi)
        if deadline is not None and time.monotonic() >= deadline:
            last.stop_reason = "time limit reached"
            return last
        chosen = choose_next(problem.num_engines, stages, replicas, ratios, fill=fill, skip=full, work=work)
        if fill and cap is None and choose_next(problem.num_engines, stages, replicas, ratios, work=work) < 0:
            cap = _max_stages(problem, engines)
        if chosen < 0:
            last.stop_reason = ("Alg. 1: the next replica of the chosen model would not fit in the engines" if not fill
                                else "no model can get another replica within the engines")
            return last
        added = chosen
        replicas[chosen] += 1
