"""The paraflex planner on a cluster of several nodes: keep a replica's stages on one node
where that costs no replica and no KV.

Place in the data flow: `paraflex.planner.api.plan` calls `optimize_on_nodes` for the
`paraflex` solver. With `Problem.node_of` set, the replica placer breaks ties between equally
good starts by the fewest hops between nodes (planner/replica_placer.py). A tie-break is
greedy: it can align an early replica to a node boundary and leave no window for a later one
(engine 0 alone on its node, four engines, a 2-stage model: 1-2 first leaves no second
window, where 0-1 and 2-3 fit two). So both plans are made, and the node-aware one is kept
only when every model has at least as many replicas, Phi* is no lower and no more hops cross
nodes; otherwise the plain plan is (its hops still cost the link between nodes in the
simulator and at serve time).
"""

from __future__ import annotations

import dataclasses

from paraflex.costs.topology import cross_node_hops
from paraflex.planner.placement_optimizer import Progress, optimize
from paraflex.planner.problem import Problem, Solution

_TIE = 1e-9


def optimize_on_nodes(problem: Problem, progress: Progress | None = None, fill: bool = True) -> Solution:
    """Alg. 1 + Alg. 2 (`optimize`), preferring replicas inside one node (module docstring)."""
    if problem.node_of is None or len(set(problem.node_of)) < 2:
        return optimize(problem, progress, fill=fill)
    aware = optimize(problem, progress, fill=fill)
    plain = optimize(dataclasses.replace(problem, node_of=None), fill=fill)
    return aware if not_worse(aware, plain, problem.node_of) else plain


def crossings(solution: Solution, node_of) -> int:
    """Pipeline hops of every replica that cross nodes."""
    return sum(cross_node_hops(node_of, r) for reps in solution.replicas for r in reps)


def not_worse(a: Solution, b: Solution, node_of) -> bool:
    """`a` has as many replicas of every model as `b`, a Phi* no lower and no more hops between nodes."""
    return (all(len(ra) >= len(rb) for ra, rb in zip(a.replicas, b.replicas))
            and a.objective_bytes >= b.objective_bytes - _TIE * max(1.0, abs(b.objective_bytes))
            and crossings(a, node_of) <= crossings(b, node_of))
