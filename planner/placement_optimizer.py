"""Placement optimizer (paper Alg. 2) driving the replication planner (Alg. 1).

Input: a `Problem` (stage cuts, stage weights, ratios, engines, memory, kappa, ring).
Output: a `Solution` (each replica's engines) that `assemble.to_placement` writes out.

Loop (Alg. 2): start with one replica per model; place every replica, models in descending
stage count (heavier first among equals, then config order), each replica at the start engine that maximises Phi*
of the partial placement (DRF, `drf`), ties -> lowest first engine; then ask Alg. 1 for the
next model to replicate and repeat. Stop when Alg. 1 returns -1, or when some replica cannot be
placed with Phi* >= kappa; then the last feasible plan is returned.

Readings of the pseudo-code's gaps (docs/plan.md):
* The threshold ``c`` is kappa (constraint 6), tested on the best start of a replica after
  the enumeration; read literally (inside the engine loop) any single bad start would abort.
* Candidate starts that break constraint (4) (overlap with the model's own replicas) or (5)
  (memory) are not candidates. Stage k of a replica starting at p runs on engine p + k (P1);
  with ``ring`` the starts wrap (engine (p + k) mod N_e), same direction.
* Phi* of a partial placement is the first DRF water level, min over used engines of
  C_e / n_e (`drf` explains why), so a candidate start is scored in O(1) amortised: numpy
  computes all starts of a replica at once, the engines outside its window via a sliding
  minimum over the doubled engine ring.
* Each iteration re-places every replica from scratch, as the paper does; since the order is
  fixed and ties are deterministic, the state before the replicated model, and after its own
  earlier replicas, is reused instead of recomputed (same result, less work: one new replica
  per iteration instead of all of that model's).

Additions beyond the pseudo-code (measured by bench/planner_quality.py, docs/plan.md):
* fail fast when the weights plus kappa on every stage exceed the cluster's memory;
* a replica that fits nowhere triggers one round of local search on the partial plan
  (`ReplicaPlacer.polish`, planner/replica_placer.py); if the iteration still fails, the model that did not fit is moved to
  the front of the order (kept for later iterations) and the iteration retried, at most 8
  times per run, then once more with the repair on, before the last feasible plan is
  returned; retries skip the repair except at the first step, to bound the cost;
* the final plan is polished by the same local search, which never lowers Phi*;
* with `Problem.balance_compute` (planner.balance_compute, the default; false is the paper's
  memory-only rule) the final plan's replicas of equal stage count then swap places where that
  evens the engines' compute load without lowering Phi* (`ReplicaPlacer.even_out`): the memory
  objective leaves many placements tied (540 on the balanced base cluster), and the most and
  the least compute-balanced of them simulated 8% apart at saturation (docs/plan.md, "Compute balance").
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from paraflex.planner.problem import NoFeasiblePlan, Problem, Solution, replica_engines
from paraflex.planner.replica_placer import ReplicaPlacer, water_levels
from paraflex.planner.replication import choose_next, replica_work
from paraflex.planner.sharding import gib

_MAX_PROMOTIONS = 8  # retries per run, each with the model that did not fit moved to the front
Progress = Callable[[int, int, float], None]  # (iteration, replicas placed, Phi* bytes)


class _Failed(Exception):
    def __init__(self, model: str, replica: int, best: float, index: int):
        self.model, self.replica, self.best, self.index = model, replica, best, index


def optimize(problem: Problem, progress: Progress | None = None, polish: bool = True, fill: bool = True) -> Solution:
    """Run Alg. 1 + Alg. 2 to completion; raises NoFeasiblePlan if the first step fails.

    With `polish` the final plan goes through `ReplicaPlacer.polish` (documented addition). With
    `fill` (default; False is the paper's rule) a model that cannot get another replica, in
    Alg. 1 or in the placement, drops out and replication goes on with the others while any
    fits (`replication.choose_next`) on spare engines only: from then on no engine may hold
    more stages than the busiest one did when the first model dropped out (`ReplicaPlacer.stage_cap`),
    so filling uses idle and empty engines without thinning every model's batches on the busy
    ones; the stop reason lists each model that dropped out.
    """
    _check_capacity(problem)
    models = problem.models
    stages = problem.stage_counts
    ratios = problem.ratios
    work = replica_work(problem)
    # descending stage count (paper); among equals heavier first (first-fit-decreasing), then config order
    order = sorted(range(len(models)), key=lambda i: (-stages[i], -models[i].weight_bytes, i))
    position = {i: q for q, i in enumerate(order)}
    promoted = 0  # retries so far with a model that did not fit moved to the front
    repair_mode = False  # reordering is spent: retries also get the local-search repair
    retrying = False  # this iteration failed before; its retries skip the repair (costly on big
    # clusters) except at the first step, where failing means no plan at all, and in repair_mode
    weights = [np.asarray(m.stage_weights, dtype=float) for m in models]
    placer = ReplicaPlacer(problem)
    n = problem.num_engines
    # snapshots[q] = (cap, cnt, starts of order[q]) after placing all replicas of order[0..q]
    snapshots: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
    replicas = [1] * len(models)
    last = None  # (cap, cnt, starts per model, iteration) of the last feasible step
    floor = max(float(problem.kappa_bytes), 0.0)
    resume = 0  # the first model of `order` this iteration places (the replicated one)
    kept = 0  # snapshots kept: those before it, and its own when its earlier replicas stand
    iteration = 0
    added = -1  # the model that got a replica for this iteration (-1: the first iteration)
    full: dict[int, str] = {}  # fill: models that cannot get another replica -> why
    while True:
        iteration += 1
        del snapshots[kept:]
        if kept:
            cap, cnt = snapshots[kept - 1][0].copy(), snapshots[kept - 1][1].copy()
        else:
            cap, cnt = np.full(n, float(problem.memory_bytes)), np.zeros(n, dtype=np.int64)
        placed = {order[q]: list(snapshots[q][2]) for q in range(kept)}
        repaired = False
        try:
            for q in range(resume, len(order)):
                i = order[q]
                if q >= kept:
                    placed[i] = []
                for j in range(len(placed[i]), replicas[i]):
                    start, best = placer.best_start(cap, cnt, placer.taken(placed[i], len(weights[i])), weights[i])
                    if (start < 0 or best < floor) and not repaired and (repair_mode or not retrying or last is None):
                        # repair: local search on what is placed so far, then try this replica again
                        keys = list(placed)
                        placer.polish(cap, cnt, [placed[k] for k in keys], [weights[k] for k in keys])
                        repaired = True
                        start, best = placer.best_start(cap, cnt, placer.taken(placed[i], len(weights[i])), weights[i])
                    if start < 0 or best < floor:
                        raise _Failed(models[i].name, j, best, i)
                    win = placer.windows(len(weights[i]))[start]
                    cap[win] -= weights[i]
                    cnt[win] += 1
                    placed[i].append(start)
                snapshot = (cap.copy(), cnt.copy(), list(placed[i]))
                if q < kept:
                    snapshots[q] = snapshot
                else:
                    snapshots.append(snapshot)
        except _Failed as fail:
            if order[0] != fail.index and promoted < min(len(models), _MAX_PROMOTIONS):
                # place the model that did not fit first, then retry this step
                order.remove(fail.index)
                order.insert(0, fail.index)
                position = {i: q for q, i in enumerate(order)}
                promoted += 1
            elif not repair_mode:
                repair_mode = True  # reordering is spent: retry with the local-search repair
            else:
                if last is None:
                    raise NoFeasiblePlan(_explain(problem, fail)) from None
                reason = (
                    f"replica {fail.replica + 1} of {fail.model} would leave a stage below kappa "
                    f"({_gb(max(fail.best, 0.0))} < {_gb(problem.kappa_bytes)}) or overflow memory"
                )
                if not fill:
                    return _finish(problem, placer, weights, last, reason, polish)
                # fill: the replicated model drops out; go on from the last feasible counts, on spare engines
                replicas[added] -= 1
                if placer.stage_cap is None:
                    placer.stage_cap = int(last[1].max())
                if placer.stage_cap is not None and not np.isfinite(fail.best):
                    full[added] = (f"no spare engine for replica {replicas[added] + 1} (each engine it could use holds "
                                   f"{placer.stage_cap} stages, as many as the busiest engine when the paper's rule stopped)")
                else:
                    full[added] = reason if fail.index == added else f"{reason} once {models[added].name} had another replica"
                chosen = choose_next(n, stages, replicas, ratios, fill=True, skip=full, work=work)
                if chosen < 0:
                    return _finish(problem, placer, weights, last, _fill_reason(models, stages, replicas, n, full), polish)
                replicas[chosen] += 1
                added = chosen
                snapshots.clear()
                resume = kept = 0
                iteration -= 1
                retrying = False  # a new step, not a retry of the failed one
                continue
            snapshots.clear()
            resume = kept = 0
            iteration -= 1
            retrying = True
            continue
        retrying = False
        if repaired:  # earlier snapshots no longer describe this iteration's state
            snapshots.clear()
        last = (cap, cnt, [placed[i] for i in range(len(models))], iteration)
        if progress:
            progress(iteration, sum(replicas), float(water_levels(cap, cnt).min()))
        chosen = choose_next(n, stages, replicas, ratios, fill=fill, skip=full, work=work)
        if fill and placer.stage_cap is None and choose_next(n, stages, replicas, ratios, work=work) < 0:
            placer.stage_cap = int(cnt.max())  # the paper's rule stops here: the fill phase starts
        if chosen < 0:
            reason = ("Alg. 1: the next replica of the chosen model would not fit in the engines" if not fill
                      else _fill_reason(models, stages, replicas, n, full))
            return _finish(problem, placer, weights, last, reason, polish)
        replicas[chosen] += 1
        added = chosen
        # The models before it, and its own replicas so far, are placed as in this iteration
        # (same state, same greedy order, same ties): reuse them and place the new replica.
        resume = min(position[chosen], len(snapshots))
        kept = min(position[chosen] + 1, len(snapshots))


def _check_capacity(problem: Problem) -> None:
    """Fail fast when one replica of every model cannot fit whatever the placement."""
    weights = sum(m.weight_bytes for m in problem.models)
    kv = problem.kappa_bytes * sum(problem.stage_counts)
    total = problem.memory_bytes * problem.num_engines
    if weights + kv > total:
        # fewer stages need less kappa in all, but only while the weights alone fit
        fix = ("add engines or memory (the weights alone exceed it)" if weights > total else
               "lower planner.kappa_gb, add engines or memory, or raise planner.target_stage_time so models have "
               "fewer stages, each with its kappa")
        raise NoFeasiblePlan(
            f"no feasible placement: one replica of every model needs {_gb(weights)} of weights plus "
            f"kappa x {sum(problem.stage_counts)} stages = {_gb(kv)} of KV, more than the cluster's {_gb(total)}; {fix}"
        )


def _fill_reason(models, stages, replicas, n: int, full: dict[int, str]) -> str:
    """Why replication stopped with `fill`: no model can get another replica; one clause each."""
    parts = []
    for i, m in enumerate(models):
        if i in full:
            parts.append(f"{m.name}: {full[i]}")
        else:
            parts.append(f"{m.name}: {replicas[i] + 1} replicas x {stages[i]} stages would exceed the {n} engines")
    return "no model can get another replica (" + "; ".join(parts) + ")"


def _finish(problem: Problem, placer: ReplicaPlacer, weights, last, reason: str, polish: bool) -> Solution:
    cap, cnt, starts, iteration = last
    if polish:
        placer.polish(cap, cnt, starts, weights)
    if problem.balance_compute:  # (after the polish, which would undo it for a higher level elsewhere)
        ratios, stage_work = problem.ratios, problem.stage_work()
        works = [ratios[i] / max(len(st), 1) * np.asarray(stage_work[i]) for i, st in enumerate(starts)]
        placer.even_out(cap, cnt, starts, weights, works)
    empty = [e for e in range(problem.num_engines) if cnt[e] == 0]
    if empty:
        reason += (f"; engine{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
                   f"hold{'' if len(empty) > 1 else 's'} no stage because of it")
    return Solution(
        replicas=[[replica_engines(p, len(weights[i]), problem.num_engines) for p in sorted(st)] for i, st in enumerate(starts)],
        objective_bytes=float(water_levels(cap, cnt).min()),
        iterations=iteration,
        stop_reason=reason,
    )


def _gb(nbytes: float) -> str:
    """Bytes in GiB, the unit of the config's memory_gb and kappa_gb."""
    return gib(nbytes)


def _explain(problem: Problem, fail: _Failed) -> str:
    # Total memory suffices (_check_capacity passed) and every stage fits an engine alone
    # (sharding raised S until it does), so what fails is packing the stages together:
    # smaller stages (a lower T_s) pack better, fewer of them would not.
    spec = problem.models[fail.index]
    return (
        f"no feasible placement: {fail.model} (replica {fail.replica + 1}, largest stage "
        f"{_gb(max(spec.stage_weights))} of weights) cannot be placed with at least kappa = {_gb(problem.kappa_bytes)} "
        f"of KV per stage beside the other models' stages within {_gb(problem.memory_bytes)} per engine on "
        f"{problem.num_engines} engines; lower planner.kappa_gb, add engines or memory, or lower "
        "planner.target_stage_time so models are cut into more, smaller stages that pack together"
    )
