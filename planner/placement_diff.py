"""The change between two placements as a list of replica actions (live re-planning, issue 22).

The incremental planner (and an operator's `POST /v1/placement`) produce a new `Placement`;
`diff_placements(old, new, weights)` says what must happen to go from the old one to the new one:
`add` a replica (load its stages' weights on its engines) or `remove` one (drain it, free its
weights and KV). A replica is kept when the new placement has one of the same model with the
same stage cut on the same engines, in the same order; kept replicas cost nothing. Replica
indices are positions in the old placement (remove) or the new one (add).

Pure: the serving controller applies the actions on engines, the simulator charges their load
time; both read the same list, so there is one rule for what a change costs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from paraflex.placement import Placement
from paraflex.planner.problem import StageWeights


@dataclass(frozen=True)
class ReplicaAction:
    """Add or remove one replica: its model, index, stage cut, engines and weight bytes moved."""

    op: str  # "add" | "remove"
    model: str
    replica: int
    stages: tuple[tuple[int, int], ...]
    engines: tuple[int, ...]
    weight_bytes: int  # loaded (add) or freed (remove), summed over the replica's stages

    def describe(self) -> str:
        where = ", ".join(f"layers {a}-{b} on engine {e}" for (a, b), e in zip(self.stages, self.engines))
        return f"{self.op} replica {self.replica} of {self.model} ({where}; {self.weight_bytes} weight bytes)"

    def to_dict(self) -> dict:
        return {"op": self.op, "model": self.model, "replica": self.replica,
                "stages": [list(s) for s in self.stages], "engines": list(self.engines),
                "weight_bytes": self.weight_bytes}


def replica_weight_bytes(stages, arch: StageWeights) -> int:
    """The weight bytes of one replica cut into `stages` (first/last stage carry embeddings/head)."""
    last = len(stages) - 1
    return sum(arch.stage_weight_bytes(a, b, k == 0, k == last) for k, (a, b) in enumerate(stages))


def _shapes(placement: Placement, model: str) -> list[tuple[tuple, tuple]]:
    m = placement.models.get(model)
    if m is None:
        return []
    cut = tuple(tuple(s) for s in m.stages)
    return [(cut, tuple(r)) for r in m.replicas]


def diff_placements(old: Placement, new: Placement, weights: Mapping[str, StageWeights]) -> list[ReplicaAction]:
    """Actions turning `old` into `new`: removals first (they free memory), then additions.

    `weights[model]` gives a model's stage weight bytes (a `ModelArch` does). Both placements
    must have the same number of engines; a model present in only one of them is all adds or
    all removes."""
    if old.num_engines != new.num_engines:
        raise ValueError(f"placements have {old.num_engines} and {new.num_engines} engines; "
                         "a live change keeps the engines and moves replicas")
    removes, adds = [], []
    for model in sorted(set(old.models) | set(new.models)):
        before, after = _shapes(old, model), _shapes(new, model)
        kept = Counter(before) & Counter(after)
        removes += [_action("remove", model, j, shape, weights) for j, shape in _not_kept(before, kept)]
        adds += [_action("add", model, j, shape, weights) for j, shape in _not_kept(after, kept)]
    return removes + adds


def _not_kept(shapes: list, kept: Counter):
    """(index, shape) of the replicas in `shapes` past the `kept` count of their shape."""
    left = Counter(kept)
    for j, shape in enumerate(shapes):
        if left[shape]:
            left[shape] -= 1
        else:
            yield j, shape


def _action(op: str, model: str, replica: int, shape, weights) -> ReplicaAction:
    stages, engines = shape
    return ReplicaAction(op, model, replica, stages, engines, replica_weight_bytes(stages, weights[model]))


def moved_bytes(actions: list[ReplicaAction]) -> int:
    """Weight bytes loaded by a change (what the host link carries; removals free memory only)."""
    return sum(a.weight_bytes for a in actions if a.op == "add")
