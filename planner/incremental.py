"""Incremental re-planning: the current placement + measured per-model rates -> a new placement
that keeps existing replicas unless the objective improves by more than a hysteresis margin,
and moves as few weight bytes as it can (live re-planning, issue 22).

Place in the data flow: the re-planning controller (planner/replan_controller.py), which the
simulator and the server both run, calls `IncrementalPlanner.replan(current, rates)`; the
answer's actions (`placement_diff.diff_placements`, each priced with its load time from the
host link, paraflex/costs/weight_load.py) are what the simulator charges and the server applies.

Objective under rates (`demand_objective`): the planner's DRF grant read per unit of demand,
min over models of r_i * a_i / (R_i * M): replicas r_i times the KV bytes a_i each of its stages
gets (drf.water_fill, as the placement file records it), per normalised rate R_i, in units of
engine memory M. A model whose traffic doubles on the same replicas halves its term; for fixed
rates the paper's planner (Alg. 1 replicas in proportion to R_i, Alg. 2 maximising Phi*) is
what raises it. Rates are floored at `RATE_FLOOR` of the total: an idle model keeps its one
replica (every model is placed) and does not make the objective infinite.

Three candidates, all scored by it:
* kept: the current placement;
* incremental: the current replicas, then for each model whose replica count the planner would
  change (Alg. 1 + 2 on the new rates, `api.plan(rates=...)`), the surplus replicas removed
  (each time the one whose removal leaves the engines' sorted DRF levels highest) and the
  missing ones added at their best start (`ReplicaPlacer.best_start`, Alg. 2's step, kappa
  kept) beside the replicas that stay: only added replicas move bytes;
* fresh: the planner's placement for the new rates (every replica may move).
With `keep_cuts` (the server's mode: a live change cannot re-cut a model) every candidate keeps
each model's current stage cut: the planner plans with the current cuts fixed
(`plan(cuts=...)`), so replicas are only added, removed or moved. Without it (the simulator,
which can load a replica of another cut beside the old ones) the cuts are the config's.
The current placement stays unless the best candidate beats it by more than `hysteresis`
(relative); otherwise the candidate moving the fewest bytes among those within the margin of
the best is taken, so a full re-layout is paid for only when it gains more than the margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from paraflex.costs.weight_load import HOST_LINK_GBPS, stage_load_time
from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.planner.api import plan
from paraflex.planner.assemble import to_placement
from paraflex.planner.placement_diff import ReplicaAction, diff_placements, moved_bytes
from paraflex.planner.problem import Problem, Solution, replica_engines
from paraflex.planner.replica_placer import ReplicaPlacer, lex_greater, water_levels
from paraflex.planner.sharding import build_problem

DEFAULT_HYSTERESIS = 0.1
RATE_FLOOR = 0.01  # share of the total rate an idle model is planned for


@dataclass(frozen=True)
class PricedAction:
    """One replica action and its load time (0 for a removal: it drains and frees)."""

    action: ReplicaAction
    load_s: float

    def to_dict(self) -> dict:
        return {**self.action.to_dict(), "load_s": self.load_s}


@dataclass
class IncrementalPlan:
    """The re-planner's answer: the placement to serve next and the actions to get there."""

    placement: Placement
    actions: list[PricedAction]
    objective_before: float  # demand_objective of the current placement under the new rates
    objective_after: float
    candidate: str  # "kept", "incremental" or "fresh"
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.actions)

    @property
    def moved_bytes(self) -> int:
        return moved_bytes([p.action for p in self.actions])


def planning_rates(rates: Mapping[str, float], models) -> dict[str, float]:
    """Measured rates -> rates the planner accepts: every model present, floored at RATE_FLOOR of the total."""
    bad = [m for m, r in rates.items() if not r >= 0]
    if bad:
        raise UserError(f"rate of {bad[0]!r} must be a number >= 0 requests/s, got {rates[bad[0]]}")
    total = sum(rates.get(m, 0.0) for m in models)
    if total <= 0:
        return {m: 1.0 for m in models}
    return {m: max(rates.get(m, 0.0), RATE_FLOOR * total) for m in models}


def demand_objective(placement: Placement, rates: Mapping[str, float], memory_bytes: int) -> float:
    """min over models of replicas x per-stage KV grant / (normalised rate x engine memory)."""
    total = sum(rates[m] for m in placement.models)
    worst = float("inf")
    for name, mp in placement.models.items():
        grant = placement.engines[mp.replicas[0][0]].kv_bytes.get(name, 0) if mp.replicas else 0
        worst = min(worst, len(mp.replicas) * grant / (rates[name] / total * memory_bytes))
    return worst


class IncrementalPlanner:
    """Re-plans one config's placement for new rates (see the module docstring)."""

    def __init__(self, config, hysteresis: float = DEFAULT_HYSTERESIS, host_link_gbps: float = HOST_LINK_GBPS,
                 keep_cuts: bool = False):
        if not 0 <= hysteresis < float("inf"):
            raise UserError(f"hysteresis must be a number >= 0 (a relative margin, e.g. 0.1), got {hysteresis}")
        self.config = config
        self.hysteresis = hysteresis
        self.host_link_gbps = host_link_gbps
        self.keep_cuts = keep_cuts
        self.problem, _ = build_problem(config)
        self.weights = {m.name: m.arch for m in config.models}
        self.memory_bytes = config.cluster.memory_bytes

    def replan(self, current: Placement, rates: Mapping[str, float]) -> IncrementalPlan:
        """The placement to serve under `rates` (model -> req/s) and the actions from `current`."""
        names = [m.name for m in self.problem.models]
        if sorted(current.models) != sorted(names) or current.num_engines != self.problem.num_engines:
            raise UserError(f"the current placement ({sorted(current.models)} on {current.num_engines} engines) is not "
                            f"for this config ({sorted(names)} on {self.problem.num_engines} engines); re-plan with its own config")
        rates = planning_rates(rates, names)
        cuts = {m: mp.stages for m, mp in current.models.items()} if self.keep_cuts else None
        try:
            fresh = plan(self.config, rates=rates, cuts=cuts)
        except UserError as exc:
            raise UserError(f"re-planning for rates {_fmt(rates)}: {exc}") from None
        problem = self.problem.with_rates(rates)
        if cuts is not None:
            problem = problem.with_cuts(cuts)
        candidates = {"kept": current, "fresh": fresh}
        incremental = self._incremental(problem, current, fresh)
        if incremental is not None:
            candidates["incremental"] = to_placement(problem, incremental, "paraflex-incremental", fresh.params)
        score = {k: demand_objective(p, rates, self.memory_bytes) for k, p in candidates.items()}
        actions = {k: diff_placements(current, p, self.weights) for k, p in candidates.items()}
        before = score["kept"]
        best = max(score.values())
        chosen = "kept"
        if best > before * (1 + self.hysteresis):
            eligible = [k for k in ("incremental", "fresh") if k in score and score[k] * (1 + self.hysteresis) >= best
                        and score[k] > before * (1 + self.hysteresis)]
            chosen = min(eligible, key=lambda k: (moved_bytes(actions[k]), -score[k]))
        placement = candidates[chosen]
        priced = [PricedAction(a, self.load_time(a)) for a in actions[chosen]]
        return IncrementalPlan(placement, priced, before, score[chosen], chosen, rates)

    def load_time(self, action: ReplicaAction) -> float:
        """Seconds until an added replica can serve: its stages load on their engines in parallel."""
        if action.op != "add":
            return 0.0
        arch = self.weights[action.model]
        last = len(action.stages) - 1
        tp = self.config.cluster.tp
        return max(stage_load_time(arch.stage_weight_bytes(a, b, k == 0, k == last), tp, self.host_link_gbps)
                   for k, (a, b) in enumerate(action.stages))

    def _incremental(self, problem: Problem, current: Placement, fresh: Placement) -> Solution | None:
        """The current replicas with surplus ones removed and missing ones added (None when the
        current placement's stage cuts are not the planner's, e.g. a hand-edited file)."""
        n = problem.num_engines
        placer = ReplicaPlacer(problem)
        weights = [np.asarray(m.stage_weights, dtype=float) for m in problem.models]
        cap, cnt = np.full(n, float(problem.memory_bytes)), np.zeros(n, dtype=np.int64)
        starts: list[list[int]] = []
        for spec, w in zip(problem.models, weights):
            mp = current.models[spec.name]
            if [tuple(s) for s in mp.stages] != list(spec.stages):
                return None
            mine = []
            for route in mp.replicas:
                if list(route) != replica_engines(route[0], spec.num_stages, n):
                    return None
                mine.append(route[0])
                placer.shift(cap, cnt, w, route[0], +1)
            starts.append(mine)
        target = [fresh.models[spec.name].num_replicas for spec in problem.models]
        for i, w in enumerate(weights):
            while len(starts[i]) > target[i]:
                starts[i].remove(_least_needed(placer, cap, cnt, w, starts[i]))
                # (_least_needed left that replica out of cap/cnt)
        order = sorted(range(len(weights)), key=lambda i: (-len(weights[i]), -weights[i].sum(), i))  # Alg. 2's order
        for i in order:
            while len(starts[i]) < target[i]:
                start, best = placer.best_start(cap, cnt, placer.taken(starts[i], len(weights[i])), weights[i])
                if start < 0 or best < problem.kappa_bytes:
                    break  # no room beside the kept replicas: fewer replicas (the objective says what that costs)
                placer.shift(cap, cnt, weights[i], start, +1)
                starts[i].append(start)
        return Solution(replicas=[[replica_engines(p, len(w), n) for p in sorted(s)] for s, w in zip(starts, weights)],
                        objective_bytes=float(water_levels(cap, cnt).min()), stop_reason="incremental re-plan")


def _least_needed(placer: ReplicaPlacer, cap: np.ndarray, cnt: np.ndarray, weights: np.ndarray, starts: list[int]) -> int:
    """The replica (start) whose removal leaves the engines' sorted levels highest; removed from cap/cnt."""
    best, best_levels = starts[0], None
    for p in starts:
        placer.shift(cap, cnt, weights, p, -1)
        levels = np.sort(water_levels(cap, cnt))
        placer.shift(cap, cnt, weights, p, +1)
        if best_levels is None or lex_greater(levels, best_levels):
            best, best_levels = p, levels
    placer.shift(cap, cnt, weights, best, -1)
    return best


def _fmt(rates: Mapping[str, float]) -> str:
    return ", ".join(f"{m}={r:.3g}" for m, r in rates.items())
