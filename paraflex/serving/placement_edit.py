"""The serving placement while a live change is under way: a replica added or taken out.

Place in the data flow: the serving frontend (paraflex/serving/frontend.py) dispatches over
`Frontend.placement`. During a live change (paraflex/serving/live_placement.py) that placement
goes through intermediate states, the old one plus the replicas added so far less those removed
so far, each a sound `Placement` (its engines list exactly the stages its models place), and
ends as the new placement. `with_replica` and `without_replica` make those states; the engines'
weight and KV figures are kept from the placement they start from (the planner's figures of
the new placement arrive with it at the end). Pure: no torch, Ray or HTTP.
"""

from __future__ import annotations

from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef


def with_replica(placement: Placement, model: str, engines: list[int]) -> Placement:
    """`placement` with one more replica of `model` (same stage cut) on `engines`, last."""
    models = _copy_models(placement)
    models[model].replicas.append(list(engines))
    return _with_models(placement, models)


def without_replica(placement: Placement, model: str, replica: int) -> Placement:
    """`placement` without replica `replica` of `model` (the later ones move down one index)."""
    models = _copy_models(placement)
    del models[model].replicas[replica]
    return _with_models(placement, models)


def replica_index(placement: Placement, model: str, engines) -> int | None:
    """The index of `model`'s replica on exactly `engines` (in stage order), or None. An engine
    holds at most one stage of a model, so the engines name a replica."""
    wanted = list(engines)
    for j, route in enumerate(placement.models[model].replicas):
        if route == wanted:
            return j
    return None


def _copy_models(placement: Placement) -> dict[str, ModelPlacement]:
    return {name: ModelPlacement(name, m.num_layers, list(m.stages), [list(r) for r in m.replicas])
            for name, m in placement.models.items()}


def _with_models(placement: Placement, models: dict[str, ModelPlacement]) -> Placement:
    engines = [EnginePlacement(e.id, [], e.weight_bytes, dict(e.kv_bytes)) for e in placement.engines]
    for name, m in models.items():
        for j, route in enumerate(m.replicas):
            for k, e in enumerate(route):
                engines[e].stages.append(StageRef(name, j, k))
    return Placement(placement.version, placement.planner, dict(placement.params), placement.objective,
                     models, engines)
