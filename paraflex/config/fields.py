"""Typed, path-aware reading of one mapping of a config file (shared by the section parsers).

Place in the data flow: the section parsers (paraflex.config.schema and the section modules
beside it: cluster, models, planner, scheduler, workload) wrap each raw YAML/JSON mapping in a
`Section`, which rejects unknown keys and reads every value with its type, range and field
path (``models[2].rate``), raising `ConfigError` with the fix; `resolve_path` makes file paths
in the config relative to the config file's folder. Sizes are written in GiB (`GIB` bytes).
"""

from __future__ import annotations

import math
import os

from paraflex.errors import ConfigError

GIB = 2**30  # humans write memory sizes in GiB (``memory_gb``, ``kappa_gb``)


class Section:
    """Typed, path-aware access to one mapping of the config; rejects unknown keys."""

    def __init__(self, data, path: str, allowed: tuple[str, ...]):
        if not isinstance(data, dict):
            raise ConfigError(path or "<top>", f"expected a mapping of keys, got {value_kind(data)}")
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ConfigError(
                join_path(path, str(unknown[0])),
                f"unknown key; allowed keys here: {', '.join(allowed)}",
            )
        self.data, self.path = data, path

    def at(self, key: str) -> str:
        return join_path(self.path, key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def str(self, key, default=None, required=False, choices=None) -> str | None:
        v = self._get(key, default, required)
        if v is None:
            return v
        if not isinstance(v, str):
            raise ConfigError(self.at(key), f"expected a string, got {value_kind(v)}")
        if choices and v not in choices:
            raise ConfigError(self.at(key), f"{v!r} is not one of: {', '.join(choices)}")
        return v

    def bool(self, key, default) -> bool:
        v = self._get(key, default, False)
        if not isinstance(v, bool):
            raise ConfigError(self.at(key), f"expected true or false, got {value_kind(v)}")
        return v

    def int(self, key, default=None, required=False, minimum=None) -> int | None:
        v = self._get(key, default, required)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise ConfigError(self.at(key), f"expected an integer, got {value_kind(v)}")
        if minimum is not None and v < minimum:
            raise ConfigError(self.at(key), f"must be >= {minimum}, got {v}")
        return v

    def num(self, key, default=None, required=False, positive=False, nonneg=False) -> float | None:
        v = self._get(key, default, required)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(self.at(key), f"expected a number, got {value_kind(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise ConfigError(self.at(key), "must be a finite number")
        if positive and v <= 0:
            raise ConfigError(self.at(key), f"must be > 0, got {v:g}")
        if nonneg and v < 0:
            raise ConfigError(self.at(key), f"must be >= 0, got {v:g}")
        return v

    def _get(self, key, default, required):
        v = self.data.get(key)
        if v is None:
            if required:
                raise ConfigError(self.at(key), "missing required key")
            return default
        return v


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def value_kind(v) -> str:
    if v is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: f"the string {v!r}", bool: f"{v}"}.get(
        type(v), f"{type(v).__name__} {v!r}"
    )


def resolve_path(path: str, base_dir: str) -> str:
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))
