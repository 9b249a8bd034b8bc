"""DRF over the engines' KV capacities: how much KV each model gets per stage for a placement.

Input: each engine's free capacity C_e = M - (weights resident there) (eq. 1) and, per model,
the engines that hold one of its stages. Output: per model, the KV bytes each of its stages
gets. Used by Alg. 2 (`placement_optimizer`) through `min_level`, by `assemble` for the
`kv_bytes` the placement file records, and by `validate`.

Reading of §4.2 (see docs/plan.md): every engine's KV capacity is its own resource type. Even
sharding makes a model's KV demand the same number of bytes on each of its resident stages
(a pipeline replica holds a token's KV on every stage, so uneven per-stage grants would be
wasted), so a model's allocation is one number a_i granted on every stage it owns. Shares are
measured against the engine memory M, which is uniform, so a model's share is a_i / M on every
stage and eq. (2)'s "minimum per-stage share" equals its dominant share. Progressive filling
(water-filling) raises all unfrozen models' a_i together; when an engine's capacity is used up,
every model resident there freezes. Its first water level, min over used engines of C_e / n_e
(n_e = stages on e), is the minimum per-stage allocation of any model: Phi* in bytes.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

_REL_TOL = 1e-12


def min_level(capacity: Sequence[float], stage_count: Sequence[int]) -> float:
    """Phi* in bytes: min over engines holding stages of C_e / n_e (inf when nothing is placed)."""
    best = float("inf")
    for c, n in zip(capacity, stage_count):
        if n > 0:
            best = min(best, c / n)
    return best


def water_fill(capacity: Sequence[float], residency: Mapping[str, Iterable[int]]) -> dict[str, float]:
    """Progressive filling: per model, the KV bytes granted to each of its stages.

    `residency[model]` lists the engine of every stage of every replica (an engine may repeat
    only in hand-built inputs; it then counts once per stage). A negative capacity (weights
    over memory) yields a zero grant for the models there; `validate` reports the overload.
    """
    engines_of = {m: list(es) for m, es in residency.items()}
    count: dict[int, int] = {}
    for es in engines_of.values():
        for e in es:
            count[e] = count.get(e, 0) + 1
    frozen_use = {e: 0.0 for e in count}
    active = {e: n for e, n in count.items()}
    grant: dict[str, float] = {}
    remaining = {m for m, es in engines_of.items() if es}
    for m, es in engines_of.items():
        if not es:
            grant[m] = 0.0
    while remaining:
        level = min((capacity[e] - frozen_use[e]) / n for e, n in active.items() if n > 0)
        level = max(level, 0.0)
        tol = _REL_TOL * max(1.0, abs(level))
        full = {
            e for e, n in active.items()
            if n > 0 and (capacity[e] - frozen_use[e]) / n <= level + tol
        }
        for m in sorted(remaining):
            if any(e in full for e in engines_of[m]):
                grant[m] = level
                remaining.discard(m)
                for e in engines_of[m]:
                    active[e] -= 1
                    frozen_use[e] += level
    return grant
