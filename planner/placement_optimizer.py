"""Placement optimizer (paper Alg. 2) driving the replication planner (Alg. 1).

Input: a `Problem` (stage cuts, stage weights, ratios, engines, memory, kappa, ring).
Output: a `Solution` (each replica's engines) that `assemble.to_placement` writes out.

Loop (Alg. 2): start with one replica per model; place every replica, models in descending
stage count (config order among equals), each replica at the start engine that maximises Phi*
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
  fixed and ties are deterministic, the state before the replicated model is reused instead of
  recomputed (same result, less work).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from paraflex.planner.problem import NoFeasiblePlan, Problem, Solution, replica_engines
from paraflex.planner.replication import choose_next

_TIE = 1e-9
Progress = Callable[[int, int, float], None]  # (iteration, replicas placed, Phi* bytes)


class _Failed(Exception):
    def __init__(self, model: str, replica: int, best: float):
        self.model, self.replica, self.best = model, replica, best


def _sliding_min(values: np.ndarray, width: int) -> np.ndarray:
    """out[x] = min(values[x : x + width]) for every x with a full window (van Herk/Gil-Werman)."""
    n = len(values)
    blocks = -(-n // width)
    padded = np.full(blocks * width, np.inf)
    padded[:n] = values
    grid = padded.reshape(blocks, width)
    prefix = np.minimum.accumulate(grid, axis=1).ravel()
    suffix = np.minimum.accumulate(grid[:, ::-1], axis=1)[:, ::-1].ravel()
    x = np.arange(n - width + 1)
    return np.minimum(suffix[x], prefix[x + width - 1])


class _Placer:
    """Engine state (free capacity, stage counts) and the scored placement of one replica."""

    def __init__(self, problem: Problem):
        self.n = problem.num_engines
        self.ring = problem.ring
        self.kappa = float(problem.kappa_bytes)
        self._windows: dict[int, np.ndarray] = {}

    def windows(self, s: int) -> np.ndarray:
        """Row p = engines of a replica starting at p (all starts, P1)."""
        if s not in self._windows:
            starts = np.arange(self.n if self.ring else self.n - s + 1)
            self._windows[s] = (starts[:, None] + np.arange(s)[None, :]) % self.n
        return self._windows[s]

    def best_start(self, cap: np.ndarray, cnt: np.ndarray, taken: np.ndarray, weights: np.ndarray) -> tuple[int, float]:
        """Start engine maximising Phi* for one more replica; ties -> lowest start. (-1, -inf) if none."""
        s = len(weights)
        idx = self.windows(s)
        inside = ((cap[idx] - weights[None, :]) / (cnt[idx] + 1)).min(axis=1)
        level = np.where(cnt > 0, cap / np.maximum(cnt, 1), np.inf)
        if s < self.n:  # engines outside window p are values[p + s : p + n] of the doubled ring
            outside = _sliding_min(np.concatenate([level, level]), self.n - s)[idx[:, 0] + s]
            phi = np.minimum(inside, outside)
        else:
            phi = inside
        phi[taken[idx].any(axis=1)] = -np.inf
        best = phi.max()
        if not np.isfinite(best):
            return -1, -np.inf
        tied = np.flatnonzero(phi >= best - _TIE * max(1.0, abs(best)))
        return int(idx[tied[0], 0]), float(best)


def optimize(problem: Problem, progress: Progress | None = None) -> Solution:
    """Run Alg. 1 + Alg. 2 to completion; raises NoFeasiblePlan if the first step fails."""
    models = problem.models
    stages = problem.stage_counts
    ratios = problem.ratios
    order = sorted(range(len(models)), key=lambda i: (-stages[i], i))
    position = {i: q for q, i in enumerate(order)}
    weights = [np.asarray(m.stage_weights, dtype=float) for m in models]
    placer = _Placer(problem)
    fresh = (np.full(problem.num_engines, float(problem.memory_bytes)), np.zeros(problem.num_engines, dtype=np.int64))
    # snapshots[q] = (cap, cnt, starts of order[q]) after placing all replicas of order[0..q]
    snapshots: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
    replicas = [1] * len(models)
    last: Solution | None = None
    resume = 0
    iteration = 0
    while True:
        iteration += 1
        del snapshots[resume:]
        cap, cnt = (snapshots[resume - 1][0].copy(), snapshots[resume - 1][1].copy()) if resume else (fresh[0].copy(), fresh[1].copy())
        try:
            for q in range(resume, len(order)):
                i = order[q]
                taken = np.zeros(problem.num_engines, dtype=bool)
                starts = []
                for j in range(replicas[i]):
                    start, best = placer.best_start(cap, cnt, taken, weights[i])
                    if start < 0 or best < max(placer.kappa, 0.0):
                        raise _Failed(models[i].name, j, best)
                    win = placer.windows(len(weights[i]))[start]
                    cap[win] -= weights[i]
                    cnt[win] += 1
                    taken[win] = True
                    starts.append(start)
                snapshots.append((cap.copy(), cnt.copy(), starts))
        except _Failed as fail:
            if last is None:
                raise NoFeasiblePlan(_explain(problem, fail)) from None
            last.stop_reason = (
                f"replica {fail.replica + 1} of {fail.model} would leave a stage below kappa "
                f"({_gb(max(fail.best, 0.0))} < {_gb(problem.kappa_bytes)}) or overflow memory"
            )
            return last
        used = cnt > 0
        objective = float((cap[used] / cnt[used]).min())
        last = Solution(
            replicas=[
                [replica_engines(p, stages[i], problem.num_engines) for p in snapshots[position[i]][2]]
                for i in range(len(models))
            ],
            objective_bytes=objective,
            iterations=iteration,
        )
        if progress:
            progress(iteration, sum(replicas), objective)
        chosen = choose_next(problem.num_engines, stages, replicas, ratios)
        if chosen < 0:
            last.stop_reason = "Alg. 1: the next replica of the chosen model would not fit in the engines"
            return last
        replicas[chosen] += 1
        resume = position[chosen]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def _explain(problem: Problem, fail: _Failed) -> str:
    return (
        f"no feasible placement: {fail.model} (replica {fail.replica + 1}) cannot be placed with at least "
        f"kappa = {_gb(problem.kappa_bytes)} of KV per stage within {_gb(problem.memory_bytes)} per engine "
        f"on {problem.num_engines} engines; lower planner.kappa_gb, add engines or memory, or raise "
        "planner.target_stage_time so models have fewer stages"
    )
