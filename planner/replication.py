"""Replication planner (paper Alg. 1): which model gets the next replica.

Called by the placement loop (`placement_optimizer.optimize`, `milp.solve`) once per
iteration with the current replica counts; returns the model index to replicate or -1 to stop.

Target resource ratio of model i: R_i * s_i / sum(R * s) (workload ratio times size in stages,
eq. 7); actual ratio: r_i * s_i / sum(r * s). The model whose actual:target ratio is smallest
gets the next replica; among equals the one with the largest target, then the lowest index.

Readings of the pseudo-code's gaps (docs/plan.md):
* Early return: as printed, the lines after ``return arg max_{m in U}`` sit inside the
  ``if |U| > 0`` block and could never run. We read them as the else branch: unplaced models
  first (heaviest target first), otherwise the proportional rule.
* Abort test: ``r_i * s_i > N`` on the current count can never hold once replicas do not
  overlap (eq. 4 already forces r_i * s_i <= N). We read it as "the chosen model's next replica
  would not fit": (r_i + 1) * s_i > N returns -1 ("the chosen model runs out of engines").

Departure (default, `planner.fill_engines: true`; `false` or `paraflex plan --paper-replication`
is the paper's rule): the paper stops everything as soon as the chosen model cannot get another
replica, which leaves engines idle while smaller models could still use them (in the base case
under balanced popularity llama-2-70b's third replica does not fit, so every model stopped at
two replicas and two engines held one 43 GiB stage each). With `fill`, a model that cannot get
another replica (here, or in the placement: `skip`) drops out and the next one by the same
rule gets it; -1 only when no model can. The placement (`placement_optimizer`) then puts these
extra replicas on spare engines only: none may hold more stages than the busiest engine did
when the paper's rule stopped. (Filling every engine to the memory limit instead, 8/8/8/2
replicas in the balanced base case, split each small model's traffic over 8 replicas: decode
batches of 5-9 instead of 14-16, every engine serving four models, and 15.2 instead of 17.9
req/s achieved at 32 req/s offered.)

Option beyond the paper (`planner.replica_shares: work`, `paraflex simulate --work-shares`; the
default `stages` is the paper's eq. 7): the target share weighs each model by its work, R_i x
its weight bytes (a decode step reads every weight once), instead of R_i x s_i. The two agree
while every stage takes about T_s; they part when rounding S leaves stages far from T_s: with
T_s twice the smallest model's time (dispersion-4x at `x2`) a llama-20b is half a stage of work
cut as one stage, so eq. 7 gave each llama-20b as much as half a llama-80b and four replicas,
three stages per engine, where the work share gives two (one llama-20b beside each llama-80b
stage). Since the weight bytes of a model cut in S stages and of S one-stage models differ by
their embeddings (a few %), shares within `WORK_TIE` of the least count as tied (the paper's
tie-break then applies: the largest target first). Not the default: in simulation it raised the
base cluster's balanced peak 37.1 -> 40.0 req/s but lowered Zipf 1.01's 50.9 -> 50.3, and on the
served 3-model CPU benchmark under Zipf 1.01 it gave the hot small model one replica instead of
two (goodput 0.56 vs 1.37 req/s at 4 req/s). Evidence: docs/plan.md, "Replica shares by work".
"""

from __future__ import annotations

from typing import Collection, Sequence

_TIE = 1e-12
WORK_TIE = 0.05  # relative: shares by weight bytes this close count as equal (embeddings aside)


def choose_next(num_engines: int, stages: Sequence[int], replicas: Sequence[int], ratios: Sequence[float],
                fill: bool = False, skip: Collection[int] = (), work: Sequence[float] | None = None) -> int:
    """Index of the model to replicate next, or -1 when the chosen model has no room left
    (with `fill`: when no model outside `skip` has room left). `work`: each model's size in
    its target share (its weight bytes; `replica_work`); None is the paper's, its stage count."""
    n = len(stages)
    if not (len(replicas) == len(ratios) == n) or n == 0 or (work is not None and len(work) != n):
        raise ValueError("stages, replicas, ratios (and work) must be non-empty and of equal length")
    size = stages if work is None else work
    tie = _TIE if work is None else WORK_TIE
    target_total = sum(ratios[i] * size[i] for i in range(n))
    target = [ratios[i] * size[i] / target_total for i in range(n)]
    unplaced = [i for i in range(n) if replicas[i] == 0]
    if unplaced:
        return max(unplaced, key=lambda i: (target[i], -i))
    actual_total = sum(replicas[i] * stages[i] for i in range(n))
    relative = [(replicas[i] * stages[i] / actual_total) / target[i] for i in range(n)]
    least = min(relative)
    if fill:
        # the paper's order (least relative ratio, then largest target, then index), skipping
        # models without room for another replica
        def key(i):
            tied = relative[i] <= least * (1 + tie)
            return (not tied, 0.0 if tied else relative[i], -target[i], i)

        rank = sorted(range(n), key=key)
        for i in rank:
            if i not in skip and (replicas[i] + 1) * stages[i] <= num_engines:
                return i
        return -1
    tied = [i for i in range(n) if relative[i] <= least * (1 + tie)]
    chosen = max(tied, key=lambda i: (target[i], -i))
    if (replicas[chosen] + 1) * stages[chosen] > num_engines:
        return -1
    return chosen


def replica_work(problem) -> list[float] | None:
    """The `work` argument of `choose_next` for a `Problem`: each model's weight bytes when it
    shares by work (`Problem.work_shares`), None (stage counts, eq. 7) otherwise."""
    return [float(m.weight_bytes) for m in problem.models] if problem.work_shares else None
