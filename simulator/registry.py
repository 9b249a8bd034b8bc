"""Name -> factory registries (Vidur style) for the simulator's pluggable parts.

Systems (`systems.py`), arrival processes and length distributions (`workload/`) register
themselves here under a lower-case name; the CLI and config resolve user-given names through
`Registry.get`, which raises a `UserError` listing the valid names.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from paraflex.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of factories; `kind` names the table in error messages."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        key = name.lower()

        def deco(obj: T) -> T:
            if key in self._items:
                raise ValueError(f"{self.kind} {key!r} registered twice")
            self._items[key] = obj
            return obj

        return deco

    def get(self, name: str, field: str | None = None) -> T:
        try:
            return self._items[str(name).lower()]
        except KeyError:
            where = f"{field}: " if field else ""
            raise UserError(
                f"{where}unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return str(name).lower() in self._items
