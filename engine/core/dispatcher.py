"""Dispatch over a model's replicas: home-first (the default) or least outstanding requests.

Place in the data flow: the gateway (and the simulator's front end) asks `pick(model)` which
replica a new request goes to, sends it to that replica's first-stage engine, and calls
`done(model, replica)` when the request finishes or is aborted. Pure Python, no I/O.

Least outstanding (paper §5, first paragraph; `scheduler.dispatch: least-outstanding`): the
replica with the fewest unfinished requests, ties to the lowest replica index (the placement
lists replicas in a stable order).

Home-first (`scheduler.dispatch: home-first`, departure from the paper; docs/engine-core.md):
each model has a home replica (`home_replicas.py` spreads the homes over the engines by
demand); a request goes home unless the home holds `margin` or more requests than the least
loaded replica, and then by the least-outstanding rule. Under light load a model's requests
stay on one engine, so an engine hosting several models' replicas mostly runs one model's
decode steps instead of taking turns among all of them (whose TPOT is then the sum of every
resident model's step); under heavy load the counts stay within `margin` of each other, which
is least outstanding again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paraflex.engine.core.home_replicas import home_replicas
from paraflex.errors import ConfigError, ParaflexError, UserError

DISPATCH_RULES = ("home-first", "least-outstanding")


class Dispatcher:
    """Outstanding-request counters per (model, replica), and each model's home replica."""

    def __init__(self, replicas: Mapping[str, int], homes: Mapping[str, int] | None = None, margin: int = 0):
        """`replicas` maps each model name to its number of replicas (>= 1); `homes` maps models
        to their home replica (none: least outstanding for every model); `margin`: how many more
        requests than the least loaded replica a home may hold and still take the next one."""
        self._outstanding: dict[str, list[int]] = {}
        for model, n in replicas.items():
            if n < 1:
                raise ConfigError(f"placement.models.{model}.replicas", f"needs at least one replica (got {n})")
            self._outstanding[model] = [0] * n
        if margin < 0:
            raise ConfigError("scheduler.home_margin", f"must be >= 0 (got {margin})")
        self.margin = margin
        self.homes = {m: h for m, h in (homes or {}).items() if 0 <= h < len(self._outstanding.get(m, ()))}

    @classmethod
    def from_placement(cls, placement, config=None) -> "Dispatcher":
        """Counters for every model of a `paraflex.placement.Placement`; with a `config`, its
        `scheduler.dispatch` rule (homes from the config's rates and weight bytes), without one
        least outstanding."""
        replicas = {name: len(mp.replicas) for name, mp in placement.models.items()}
        if config is None or config.scheduler.dispatch == "least-outstanding":
            return cls(replicas)
        demand = {m.name: m.rate * m.arch.weight_bytes() for m in config.models}
        routes = {name: mp.replicas for name, mp in placement.models.items()}
        return cls(replicas, home_replicas(routes, demand), config.scheduler.home_margin)

    def _counts(self, model: str) -> list[int]:
        counts = self._outstanding.get(model)
        if counts is None:
            raise UserError(f"unknown model {model!r}; served models: {', '.join(sorted(self._outstanding))}")
        return counts

    def pick(self, model: str, among: Iterable[int] | None = None) -> int | None:
        """The model's home while it holds fewer than `margin` requests more than the least
        loaded candidate, else the candidate with the fewest outstanding requests (lowest index
        on ties), counted; only the replicas `among` (e.g. the live ones) when given, None
        when that is empty."""
        counts = self._counts(model)
        candidates = range(len(counts)) if among is None else sorted(among)
        best = min(candidates, key=counts.__getitem__, default=None)
        home = self.homes.get(model)
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

    def add_replica(self, model: str) -> int:
        """A replica of `model` joins (live re-planning); returns its index."""
        counts = self._counts(model)
        counts.append(0)
        return len(counts) - 1

    def remove_replica(self, model: str, replica: int) -> None:
        """Replica `replica` of `model` leaves (it has no outstanding request); the later ones
        move down one index (a model whose home leaves has none: least outstanding)."""
        counts = self._counts(model)
        if counts[replica]:
            raise ParaflexError(f"dispatcher: replica {replica} of {model!r} still has {counts[replica]} request(s)")
        del counts[replica]
        home = self.homes.get(model)
        if home == replica:
            del self.homes[model]
        elif home is not None and home > replica:
            self.homes[model] = home - 1

    def reorder(self, model: str, order: list[int]) -> None:
        """Renumber `model`'s replicas: new index i is old index order[i]."""
        counts = self._counts(model)
        self._outstanding[model] = [counts[j] for j in order]
        if model in self.homes:
            self.homes[model] = order.index(self.homes[model])

    def outstanding(self, model: str) -> list[int]:
        """Outstanding requests per replica of `model` (a copy)."""
        return list(self._counts(model))
