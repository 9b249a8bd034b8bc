"""The `--random-placement` ablation of §8.5: ParaFlex's sharding and replication, stages
scattered at random instead of the same-order DRF placement.

Input: the ParaFlex placement (its stage cuts and replica counts are kept). Output: a placement
whose stages sit on engines drawn with a seeded generator such that every engine holds the
same number of stages (±1, for load balance), no engine holds two stages of one model (the
replicas do not overlap), and every engine's weights fit in its memory. systems.py calls it.
"""

from __future__ import annotations

import numpy as np

from paraflex.errors import UserError
from paraflex.placement import EnginePlacement, Placement, StageRef

ATTEMPTS = 200


def random_placement(base: Placement, archs: dict, memory_bytes: int, seed: int) -> Placement:
    """Scatter `base`'s stages uniformly at random; raises UserError if no draw fits."""
    rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(0x5EED,)))
    refs = [StageRef(name, j, k) for name, m in base.models.items() for j in range(m.num_replicas) for k in range(m.num_stages)]
    n = base.num_engines
    weight = {}
    for ref in refs:
        m = base.models[ref.model]
        a, b = m.stages[ref.stage]
        weight[ref] = archs[ref.model].stage_weight_bytes(a, b, ref.stage == 0, ref.stage == m.num_stages - 1)
    cap = -(-len(refs) // n)
    for _ in range(ATTEMPTS):
        order = [refs[i] for i in rng.permutation(len(refs))]
        slots: list[list[StageRef]] = [[] for _ in range(n)]
        used = [0] * n
        ok = True
        for ref in order:
            fewest = min(len(s) for s in slots)
            choices = [e for e in range(n) if len(slots[e]) <= fewest and len(slots[e]) < cap
                       and all(r.model != ref.model for r in slots[e]) and used[e] + weight[ref] <= memory_bytes]
            if not choices:
                choices = [e for e in range(n) if len(slots[e]) < cap and all(r.model != ref.model for r in slots[e])
                           and used[e] + weight[ref] <= memory_bytes]
            if not choices:
                ok = False
                break
            e = choices[int(rng.integers(len(choices)))]
            slots[e].append(ref)
            used[e] += weight[ref]
        if ok:
            return _build(base, slots, used)
    raise UserError(
        f"--random-placement: no uniform random layout of {len(refs)} stages on {n} engines fits memory "
        f"after {ATTEMPTS} draws; use the planner's placement or add engines"
    )


def _build(base: Placement, slots: list[list[StageRef]], used: list[int]) -> Placement:
    replicas = {name: [[-1] * m.num_stages for _ in range(m.num_replicas)] for name, m in base.models.items()}
    for e, refs in enumerate(slots):
        for r in refs:
            replicas[r.model][r.replica][r.stage] = e
    models = {name: type(m)(name, m.num_layers, list(m.stages), replicas[name]) for name, m in base.models.items()}
    engines = [EnginePlacement(e, sorted(slots[e], key=lambda r: (r.model, r.replica, r.stage)), used[e], {}) for e in range(len(slots))]
    params = dict(base.params, random_placement=True)
    return Placement(base.version, f"{base.planner}+random", params, base.objective, models, engines)
