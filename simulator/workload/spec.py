"""How a simulation's requests are made: the workload section of a simulation, resolved.

Built from the config's `workload:` section (paraflex.config.WorkloadConfig when present) plus
CLI overrides in paraflex/commands/simulate.py; consumed by generator.py. Plain data, saved
with the results so a run can be repeated.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from paraflex.errors import ConfigError

ARRIVALS = ("trace", "poisson", "lognormal")


@dataclass(frozen=True)
class WorkloadSpec:
    """arrival: `trace` (replay `trace` CSV), `poisson` or `lognormal` (inter-arrival CV `cv`).
    popularity: `zipf` (share of rank k ∝ k^-zipf_alpha, smallest model first, as §8.1),
    `uniform`, or `config` (proportional to each model's configured `rate`).
    lengths: `trace` (the trace's token counts) or `builtin` (§2.1 long-tailed mixture); with
    arrival `trace` the default is the trace's own lengths.
    num_requests: expected total count; the arrival horizon is num_requests / total rate.
    """

    arrival: str = "poisson"
    cv: float = 1.0
    trace: str | None = None
    popularity: str = "zipf"
    zipf_alpha: float = 1.01
    lengths: str = "builtin"
    num_requests: int = 2000
    context_scale: float = 1.0
    output_scale: float = 1.0

    def validate(self) -> "WorkloadSpec":
        p = "workload"
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"{p}.arrival", f"unknown arrival process {self.arrival!r}; choose one of {', '.join(ARRIVALS)}")
        if self.popularity not in ("zipf", "uniform", "config"):
            raise ConfigError(f"{p}.popularity", f"unknown popularity {self.popularity!r}; choose zipf, uniform or config")
        if self.lengths not in ("trace", "builtin"):
            raise ConfigError(f"{p}.lengths", f"unknown length source {self.lengths!r}; choose trace or builtin")
        if (self.arrival == "trace" or self.lengths == "trace") and not self.trace:
            raise ConfigError(f"{p}.trace", "a trace CSV is needed for trace arrivals or lengths; set workload.trace or pass --trace")
        if self.trace and not os.path.isfile(self.trace):
            raise ConfigError(f"{p}.trace", f"trace file {self.trace!r} not found; pass an existing arrived_at,num_prefill_tokens,num_decode_tokens CSV")
        if not self.cv > 0:
            raise ConfigError(f"{p}.cv", f"must be > 0, got {self.cv}")
        if not self.zipf_alpha >= 0:
            raise ConfigError(f"{p}.zipf_alpha", f"must be >= 0, got {self.zipf_alpha}")
        if int(self.num_requests) != self.num_requests or self.num_requests < 1:
            raise ConfigError(f"{p}.num_requests", f"must be a positive integer, got {self.num_requests}")
        for name in ("context_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{p}.{name}", f"must be > 0, got {getattr(self, name)}")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "WorkloadSpec":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"workload.{unknown[0]}", f"unknown key; known keys: {', '.join(sorted(known))}")
        if d.get("arrival") == "trace" and "lengths" not in d:
            d["lengths"] = "trace"
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
