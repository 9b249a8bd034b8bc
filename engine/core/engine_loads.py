"""Expected decode load per engine, for least-load dispatch (`scheduler.dispatch: least-load`).

Place in the data flow: the `Dispatcher` (engine/core/dispatcher.py) owns one. For a new
request it asks `cost(counts, model, replica)` of each candidate replica (the expected decode
cycle of that replica's busiest engine once the request joins, `after`, plus a weight read
where the model is idle), with its own outstanding counts, and tells it when replicas are
added, removed or renumbered. The costs come from the cost model once per placement
(`stage_costs`). Pure Python.

Model: an engine takes turns among the decode batches of its resident stages, so one round of
them (its cycle) lasts the sum of their steps, over the stages whose replica has unfinished
requests. A stage step of n requests costs ceil(n / max_batch) x `fixed` (the step's cost at
batch 1 less one request: mostly reading the stage's weights) + n x `per_request` (one more
row's compute and KV reads at `REFERENCE_CONTEXT` tokens). So one more request costs
`per_request` on an engine where its replica is already active, and also `fixed` where it is
not (or where its batches are full). `cost` adds that weight read once more for a replica
where the model is idle: a model spills there only when the engines are emptier by more than
the read the spill adds and the batch it splits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from paraflex.errors import ParaflexError

# tokens of context per request at which a decode row's cost is taken (a prompt of a few
# hundred tokens plus its output; the split between fixed and per-request cost is what counts)
REFERENCE_CONTEXT = 512


class StageCost(NamedTuple):
    """Seconds of one decode step of a stage: `fixed` per batch, `per_request` per request."""

    fixed: float
    per_request: float


def stage_costs(placement, archs: Mapping[str, object], cost, max_batch: int) -> dict[str, list[StageCost]]:
    """`StageCost` of every stage of every model of `placement` (stage order), from `cost`
    (a `CostModel`'s `decode_time`) at batch 1 and at `max_batch` requests of
    `REFERENCE_CONTEXT` tokens; `archs` maps model names to their `ModelArch`."""
    batch = max(2, max_batch)
    out: dict[str, list[StageCost]] = {}
    for name, mp in placement.models.items():
        arch, last = archs[name], len(mp.stages) - 1
        costs = []
        for s, (a, b) in enumerate(mp.stages):
            one = cost.decode_time(arch, b - a, 1, REFERENCE_CONTEXT, first=s == 0, last=s == last)
            full = cost.decode_time(arch, b - a, batch, batch * REFERENCE_CONTEXT, first=s == 0, last=s == last)
            per_request = max(0.0, (full - one) / (batch - 1))
            costs.append(StageCost(max(0.0, one - per_request), per_request))
        out[name] = costs
    return out


class EngineLoads:
    """Which stages sit on which engine and what their steps cost; each engine's expected decode
    cycle from outstanding counts per (model, replica) that the caller passes in (`counts`:
    model -> one count per replica, the dispatcher's)."""

    def __init__(self, routes: Mapping[str, Sequence[Sequence[int]]], costs: Mapping[str, Sequence[StageCost]],
                 max_batch: int):
        """`routes`: model -> its replicas' engine lists (stage order); `costs`: model -> its
        stages' `StageCost`; `max_batch`: requests per decode batch."""
        if max_batch < 1:
            raise ParaflexError(f"engine loads: max_batch must be >= 1 (got {max_batch})")
        self._costs = {m: list(c) for m, c in costs.items()}
        self._max_batch = max_batch
        self._routes: dict[str, list[tuple[int, ...]]] = {}
        for model, model_routes in routes.items():
            for route in model_routes:
                self._check(model, route)
            self._routes[model] = [tuple(r) for r in model_routes]
        self._residents: dict[int, list[tuple[str, int, StageCost]]] = {}
        self._index()

    def _check(self, model: str, route: Sequence[int]) -> None:
        stages = len(self._costs.get(model, ()))
        if len(route) != stages:
            raise ParaflexError(f"engine loads: a replica of {model!r} on {list(route)} does not match its {stages} stage cost(s)")

    def _index(self) -> None:
        """engine -> the (model, replica, stage cost) of every stage it holds."""
        self._residents = {}
        for model, model_routes in self._routes.items():
            for replica, route in enumerate(model_routes):
                for c, engine in zip(self._costs[model], route):
                    self._residents.setdefault(engine, []).append((model, replica, c))

    def _step(self, c: StageCost, n: int) -> float:
        return 0.0 if n <= 0 else -(-n // self._max_batch) * c.fixed + n * c.per_request

    def load(self, counts: Mapping[str, list[int]], engine: int) -> float:
        """Seconds of `engine`'s expected decode cycle under `counts`."""
        return sum(self._step(c, counts[m][r]) for m, r, c in self._residents.get(engine, ()))

    def after(self, counts: Mapping[str, list[int]], model: str, replica: int) -> float:
        """The cycle of the busiest engine of `model`'s `replica` once one more request joins it."""
        n = counts[model][replica]
        return max(self.load(counts, engine) + self._step(c, n + 1) - self._step(c, n)
                   for c, engine in zip(self._costs[model], self._routes[model][replica]))

    def cost(self, counts: Mapping[str, list[int]], model: str, replica: int) -> float:
        """What one more request of `model` on `replica` costs: its own expected time per token
        there (`after`), plus, where the model has no request on the replica yet, the weight
        read of the replica's largest stage once more: a spill onto idle weights must save more
        than the step it adds to those engines' cycle, so a model stays whole on its replicas
        until the difference in load pays for that read."""
        extra = 0.0 if counts[model][replica] else max(c.fixed for c in self._costs[model])
        return self.after(counts, model, replica) + extra

    def add_replica(self, model: str, route: Sequence[int]) -> None:
        """A replica of `model` on `route` joined, as the model's last index."""
        self._check(model, route)
        self._routes.setdefault(model, []).append(tuple(route))
        self._index()

    def remove_replica(self, model: str, replica: int) -> None:
        """`model`'s `replica` left (the later ones move down one index)."""
        del self._routes[model][replica]
        self._index()

    def reorder(self, model: str, order: list[int]) -> None:
        """New index i of `model`'s replicas is old index order[i]."""
        self._routes[model] = [self._routes[model][j] for j in order]
        self._index()
