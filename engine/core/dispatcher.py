"""Dispatch over a model's replicas: least load (the default), home-first, or least outstanding requests.

Place in the data flow: the gateway (and the simulator's front end) asks `pick(model)` which
replica a new request goes to, sends it to that replica's first-stage engine, and calls
`done(model, replica)` when the request finishes or is aborted. Pure Python, no I/O.

Least outstanding (paper §5, first paragraph; `scheduler.dispatch: least-outstanding`): the
replica with the fewest unfinished requests, ties to the lowest replica index (the placement
lists replicas in a stable order).

Home-first (`scheduler.dispatch: home-first`, the previous default; docs/engine-core.md):
each model has a home replica (`home_replicas.py` spreads the homes over the engines by
demand); a request goes home unless the home holds `margin` or more requests than the least
loaded replica, and then by the least-outstanding rule. Under light load a model's requests
stay on one engine, so an engine hosting several models' replicas mostly runs one model's
decode steps instead of taking turns among all of them (whose TPOT is then the sum of every
resident model's step); under heavy load the counts stay within `margin` of each other, which
is least outstanding again.

Least load (`scheduler.dispatch: least-load`, the default; departure from the paper; docs/engine-core.md):
the replica whose busiest engine has the shortest expected decode cycle once the request joins
(`engine_loads.py`: every resident model's steps, from the cost model), ties to the home, then
the lowest index. A replica whose model has no request there yet counts its weight read twice:
once as the step it adds to those engines' cycle, once more as the price of splitting the
model's decode batch. So a model stays whole on its home until the home's engines are busier
than another replica's by more than a weight read, engines hosting several models keep each
model's batch whole, and a busy model spreads over replicas where it is already active.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paraflex.engine.core.engine_loads import EngineLoads, stage_costs
from paraflex.engine.core.home_replicas import home_replicas
from paraflex.errors import ConfigError, ParaflexError, UserError

DISPATCH_RULES = ("least-load", "home-first", "least-outstanding")


class Dispatcher:
    """Outstanding-request counters per (model, replica), and each model's home replica."""

    def __init__(self, replicas: Mapping[str, int], homes: Mapping[str, int] | None = None, margin: int = 0,
                 loads: EngineLoads | None = None):
        """`replicas` maps each model name to its number of replicas (>= 1); `homes` maps models
        to their home replica (none: least outstanding for every model); `margin`: how many more
        requests than the least loaded replica a home may hold and still take the next one;
        `loads`: the engines' stages and step costs for least-load dispatch."""
        self._outstanding: dict[str, list[int]] = {}
        for model, n in replicas.items():
            if n < 1:
                raise ConfigError(f"placement.models.{model}.replicas", f"needs at least one replica (got {n})")
            self._outstanding[model] = [0] * n
        if margin < 0:
            raise ConfigError("scheduler.home_margin", f"must be >= 0 (got {margin})")
        self.margin = margin
        self.homes = {m: h for m, h in (homes or {}).items() if 0 <= h < len(self._outstanding.get(m, ()))}
        self.loads = loads

    @classmethod
    def from_placement(cls, placement, config=None, cost=None) -> "Dispatcher":
        """Counters for every model of a `paraflex.placement.Placement`; with a `config`, its
        `scheduler.dispatch` rule (homes from the config's rates and weight bytes; least load's
        step costs from `cost`, a `CostModel`, else the config's), without one least
        outstanding."""
        replicas = {name: len(mp.replicas) for name, mp in placement.models.items()}
        rule = None if config is None else config.scheduler.dispatch
        if rule is None or rule == "least-outstanding":
            return cls(replicas)
        demand = {m.name: m.rate * m.arch.weight_bytes() for m in config.models}
        routes = {name: mp.replicas for name, mp in placement.models.items()}
        homes = home_replicas(routes, demand)
        if rule == "home-first":
            return cls(replicas, homes, config.scheduler.home_margin)
        batch = config.scheduler.max_batch_size
        archs = {m.name: m.arch for m in config.models}
        costs = stage_costs(placement, archs, cost if cost is not None else config.cluster.cost_model(), batch)
        return cls(replicas, homes, loads=EngineLoads(routes, costs, batch))

    def _counts(self, model: str) -> list[int]:
        counts = self._outstanding.get(model)
        if counts is None:
            raise UserError(f"unknown model {model!r}; served models: {', '.join(sorted(self._outstanding))}")
        return counts

    def pick(self, model: str, among: Iterable[int] | None = None) -> int | None:
        """Least load: the candidate with the shortest expected busiest-engine cycle after it
        (home, then lowest index on ties). Otherwise the model's home while it holds fewer than
        `margin` requests more than the least loaded candidate, else the candidate with the
        fewest outstanding requests (lowest index on ties). Counted; only the replicas `among`
        (e.g. the live ones) when given, None when that is empty."""
        counts = self._counts(model)
        candidates = range(len(counts)) if among is None else sorted(among)
        home = self.homes.get(model)
        if self.loads is not None:
            cost, outstanding = self.loads.cost, self._outstanding
            best = min(candidates, key=lambda j: (cost(outstanding, model, j), j != home, j), default=None)
        else:
            best = min(candidates, key=counts.__getitem__, default=None)
            if best is not None and home is not None and home in candidates and counts[home] < counts[best] + self.margin:
                best = home
        if best is not None:
            counts[best] += 1
        return best

    def done(self, model: str, replica: int) -> None:
        """A request of `model` on `replica` finished or was aborted."""
        counts = self._counts(model)
        if not 0 <= replica < len(counts) or counts[replica] == 0:
            raise ParaflexError(f"dispatcher: done({model!r}, {replica}) without a matching pick")
        counts[replica] -= 1

    def add_replica(self, model: str, route: list[int] | None = None) -> int:
        """A replica of `model` on engines `route` (stage order; needed by least load) joins
        (live re-planning); returns its index."""
        counts = self._counts(model)
        if self.loads is not None:
            if route is None:
                raise ParaflexError(f"dispatcher: least-load dispatch needs the engines of {model!r}'s new replica")
            self.loads.add_replica(model, route)
        counts.append(0)
        return len(counts) - 1

    def remove_replica(self, model: str, replica: int) -> None:
        """Replica `replica` of `model` leaves (it has no outstanding request); the later ones
        move down one index (a model whose home leaves has none: least outstanding)."""
        counts = self._counts(model)
        if counts[replica]:
            raise ParaflexError(f"dispatcher: replica {replica} of {model!r} still has {counts[replica]} request(s)")
        del counts[replica]
        if self.loads is not None:
            self.loads.remove_replica(model, replica)
        home = self.homes.get(model)
        if home == replica:
            del self.homes[model]
        elif home is not None and home > replica:
            self.homes[model] = home - 1

    def reorder(self, model: str, order: list[int]) -> None:
        """Renumber `model`'s replicas: new index i is old index order[i]."""
        counts = self._counts(model)
        self._outstanding[model] = [counts[j] for j in order]
        if self.loads is not None:
            self.loads.reorder(model, order)
        if model in self.homes:
            self.homes[model] = order.index(self.homes[model])

    def outstanding(self, model: str) -> list[int]:
        """Outstanding requests per replica of `model` (a copy)."""
        return list(self._counts(model))
