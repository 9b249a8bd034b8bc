"""Least-outstanding-requests dispatch over a model's replicas (paper §5, first paragraph).

Place in the data flow: the gateway (and the simulator's front end) asks `pick(model)` which
replica a new request goes to, sends it to that replica's first-stage engine, and calls
`done(model, replica)` when the request finishes or is aborted. Ties go to the lowest replica
index (the placement lists replicas in a stable order). Pure Python, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paraflex.errors import ConfigError, ParaflexError, UserError


class Dispatcher:
    """Outstanding-request counters per (model, replica)."""

    def __init__(self, replicas: Mapping[str, int]):
        """`replicas` maps each model name to its number of replicas (>= 1)."""
        self._outstanding: dict[str, list[int]] = {}
        for model, n in replicas.items():
            if n < 1:
                raise ConfigError(f"placement.models.{model}.replicas", f"needs at least one replica (got {n})")
            self._outstanding[model] = [0] * n

    @classmethod
    def from_placement(cls, placement) -> "Dispatcher":
        """Counters for every model of a `paraflex.placement.Placement`."""
        return cls({name: len(mp.replicas) for name, mp in placement.models.items()})

    def _counts(self, model: str) -> list[int]:
        counts = self._outstanding.get(model)
        if counts is None:
            raise UserError(f"unknown model {model!r}; served models: {', '.join(sorted(self._outstanding))}")
        return counts

    def pick(self, model: str, among: Iterable[int] | None = None) -> int | None:
        """The replica with the fewest outstanding requests (lowest index on ties), counted;
        only the replicas `among` (e.g. the live ones) when given, None when that is empty."""
        counts = self._counts(model)
        candidates = range(len(counts)) if among is None else sorted(among)
        best = min(candidates, key=counts.__getitem__, default=None)
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
        move down one index."""
        counts = self._counts(model)
        if counts[replica]:
            raise ParaflexError(f"dispatcher: replica {replica} of {model!r} still has {counts[replica]} request(s)")
        del counts[replica]

    def reorder(self, model: str, order: list[int]) -> None:
        """Renumber `model`'s replicas: new index i is old index order[i]."""
        counts = self._counts(model)
        self._outstanding[model] = [counts[j] for j in order]

    def outstanding(self, model: str) -> list[int]:
        """Outstanding requests per replica of `model` (a copy)."""
        return list(self._counts(model))
