"""Home replicas for home-first dispatch: which replica of each model takes its requests first.

Place in the data flow: `Dispatcher.from_placement` (engine/core/dispatcher.py) calls
`home_replicas` once per placement, with each model's replicas (engine lists) and its demand
(rate x weight bytes: a decode step reads every weight once, so a model's share of an engine's
time grows with both). Pure Python.

Rule: models in descending demand (then name) each take the replica whose busiest engine
carries the least home demand so far (ties: the lowest replica index), and add their demand,
split evenly over the replica's stages, to its engines. A model alone on its engines keeps its
home there; two models with replicas on the same two engines get different engines as homes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def home_replicas(routes: Mapping[str, Sequence[Sequence[int]]], demand: Mapping[str, float]) -> dict[str, int]:
    """Home replica index per model of `routes` (model -> its replicas' engine lists);
    `demand` gives each model's weight (missing: 0)."""
    load: dict[int, float] = {}
    homes: dict[str, int] = {}
    for model in sorted(routes, key=lambda m: (-demand.get(m, 0.0), m)):
        replicas = routes[model]
        if not replicas:
            continue
        home = min(range(len(replicas)), key=lambda j: (max(load.get(e, 0.0) for e in replicas[j]), j))
        share = demand.get(model, 0.0) / len(replicas[home])
        for engine in replicas[home]:
            load[engine] = load.get(engine, 0.0) + share
        homes[model] = home
    return homes
