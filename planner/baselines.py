"""Baseline layouts for comparisons (§8.1), in the same `Solution` form as the ParaFlex planner.

Each takes the sharded `Problem` (only its models, rates, engines and memory matter: the
baselines cut models their own way) and returns the `Problem` with their stage cut and the
`Solution`; `assemble.to_placement` writes them as ordinary placement files.

* dedicated -- Ray Serve style: every model alone on its own engines, PP = 2 (more if two
  stages do not fit in memory, fewer if the model has one layer), no replication, models in
  config order on consecutive engines; engines left over stay idle.
* shared -- multiplexed Sarathi: every model on every engine, PP = number of engines (a model
  with fewer layers than engines uses its first L engines).
* grouped -- AlpaServe / MuxServe style: models split into a large and a small group at the
  largest size gap (ratio of weight bytes; one group if no gap exceeds 1.5x); engines divided
  between groups in proportion to sum(weight bytes x rate), every group getting at least the
  engines its weights need; inside a group every model spans all the group's engines.
* tensor -- multiplexed vLLM: one TP group over all devices: a single engine with the memory
  of all engines, every model one stage.
"""

from __future__ import annotations

import math

from paraflex.errors import UserError
from paraflex.planner.problem import Problem, Solution, replica_engines

_GROUP_GAP = 1.5


def dedicated(problem: Problem, pp: int = 2) -> tuple[Problem, Solution]:
    models, replicas, next_engine = [], [], 0
    for m in problem.models:
        s = min(pp, m.num_layers)
        spec = m.resplit(s)
        while max(spec.stage_weights) + problem.kappa_bytes > problem.memory_bytes and s < m.num_layers:
            s += 1
            spec = m.resplit(s)
        models.append(spec)
        replicas.append([list(range(next_engine, next_engine + s))])
        next_engine += s
    if next_engine > problem.num_engines:
        raise UserError(
            f"dedicated layout needs {next_engine} engines (each model alone, PP={pp} or more to fit memory) "
            f"but cluster.num_engines is {problem.num_engines}"
        )
    return _with(problem, models), Solution(replicas, 0.0)


def shared(problem: Problem) -> tuple[Problem, Solution]:
    n = problem.num_engines
    models = [m.resplit(min(n, m.num_layers)) for m in problem.models]
    return _with(problem, models), Solution([[list(range(m.num_stages))] for m in models], 0.0)


def grouped(problem: Problem) -> tuple[Problem, Solution]:
    groups = size_groups(problem)
    ratios = problem.ratios
    demand = [sum(problem.models[i].weight_bytes * ratios[i] for i in g) for g in groups]
    usable = problem.memory_bytes - problem.kappa_bytes
    need = [max(1, math.ceil(sum(problem.models[i].weight_bytes for i in g) / max(usable, 1))) for g in groups]
    counts = _apportion(problem.num_engines, demand, need)
    models = list(problem.models)
    replicas: list[list[list[int]]] = [[] for _ in models]
    first = 0
    for g, count in zip(groups, counts):
        for i in g:
            models[i] = problem.models[i].resplit(min(count, problem.models[i].num_layers))
            replicas[i] = [replica_engines(first, models[i].num_stages, problem.num_engines)]
        first += count
    return _with(problem, models), Solution(replicas, 0.0)


def tensor(problem: Problem) -> tuple[Problem, Solution]:
    merged = Problem(
        models=tuple(m.resplit(1) for m in problem.models),
        num_engines=1,
        memory_bytes=problem.memory_bytes * problem.num_engines,
        kappa_bytes=problem.kappa_bytes,
        ring=False,
    )
    return merged, Solution([[[0]] for _ in problem.models], 0.0)


def size_groups(problem: Problem) -> list[list[int]]:
    """Model indices split at the largest ratio between consecutive weight sizes (large first)."""
    order = sorted(range(len(problem.models)), key=lambda i: -problem.models[i].weight_bytes)
    sizes = [problem.models[i].weight_bytes for i in order]
    gaps = [sizes[k] / max(sizes[k + 1], 1) for k in range(len(sizes) - 1)]
    if not gaps or max(gaps) < _GROUP_GAP:
        return [sorted(order)]
    cut = gaps.index(max(gaps)) + 1
    return [sorted(order[:cut]), sorted(order[cut:])]


def _apportion(total: int, demand: list[float], need: list[int]) -> list[int]:
    """Largest-remainder split of `total` engines proportional to demand, each >= its need."""
    if sum(need) > total:
        raise UserError(f"grouped layout needs {sum(need)} engines to hold the groups' weights; cluster has {total}")
    share = [total * d / sum(demand) for d in demand]
    counts = [max(n, math.floor(s)) for n, s in zip(need, share)]
    while sum(counts) > total:  # flooring up to the needs overshot: take from the largest surplus
        k = max(range(len(counts)), key=lambda k: counts[k] - need[k])
        counts[k] -= 1
    by_remainder = sorted(range(len(counts)), key=lambda k: -(share[k] - counts[k]))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def _with(problem: Problem, models) -> Problem:
    return Problem(tuple(models), problem.num_engines, problem.memory_bytes, problem.kappa_bytes, False)
