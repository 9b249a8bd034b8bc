"""Solver answer -> `Placement`: fills in engines' resident stages, weights and DRF KV grants.

Every solver (Alg. 1 + 2, MILP, baselines) returns a `Solution` over a `Problem`; this module
turns it into the placement file the simulator and server read, so all plans carry the same
numbers computed the same way (weights from the stage cut, KV from `drf.water_fill`, Phi*).
"""

from __future__ import annotations

from paraflex.placement import VERSION, EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.planner.drf import min_level, water_fill
from paraflex.planner.problem import Problem, Solution


def to_placement(problem: Problem, solution: Solution, planner: str, params: dict) -> Placement:
    n = problem.num_engines
    engines = [EnginePlacement(e) for e in range(n)]
    models = {}
    residency: dict[str, list[int]] = {}
    for spec, reps in zip(problem.models, solution.replicas):
        models[spec.name] = ModelPlacement(spec.name, spec.num_layers, list(spec.stages), [list(r) for r in reps])
        residency[spec.name] = []
        for j, rep in enumerate(reps):
            for k, e in enumerate(rep):
                engines[e].stages.append(StageRef(spec.name, j, k))
                engines[e].weight_bytes += spec.stage_weights[k]
                residency[spec.name].append(e)
    capacity = [problem.memory_bytes - e.weight_bytes for e in engines]
    grant = water_fill(capacity, residency)
    for e in engines:
        e.stages.sort(key=lambda r: (r.model, r.replica, r.stage))
        for ref in e.stages:
            e.kv_bytes[ref.model] = int(grant[ref.model])
    phi = min_level(capacity, [len(e.stages) for e in engines])
    params = dict(params)
    params.update(
        engine_memory_bytes=problem.memory_bytes,
        kappa_bytes=problem.kappa_bytes,
        ring=problem.ring,
        objective_bytes=phi,
        rates={m.name: r for m, r in zip(problem.models, problem.ratios)},
    )
    if solution.stop_reason:
        params["stop_reason"] = solution.stop_reason
    if solution.optimal is not None:
        params["proven_optimal"] = solution.optimal
    return Placement(VERSION, planner, params, phi / problem.memory_bytes, models, engines)
