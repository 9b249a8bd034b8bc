"""The config's `workload:` section: arrival process, total rate, Zipf popularity, sizes.

Place in the data flow: `paraflex.config.schema` parses the section with `parse_workload` into a
`WorkloadConfig` (re-exported there as `paraflex.config.schema.WorkloadConfig`); `paraflex simulate`
and the benchmarks hand it to the workload generator (simulator/workload), which splits the
total rate over models by `WorkloadConfig.model_shares`. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paraflex.config.fields import Section, resolve_path
from paraflex.errors import ConfigError

if TYPE_CHECKING:
    from paraflex.config.models import ModelConfig

ARRIVALS = ("poisson", "lognormal", "trace")


@dataclass
class WorkloadConfig:
    arrival: str = "poisson"
    cv: float = 2.0  # lognormal inter-arrival coefficient of variation
    trace: str | None = None  # CSV arrived_at,num_prefill_tokens,num_decode_tokens
    rate: float | None = None  # total req/s, split over models by their relative rates
    zipf_alpha: float | None = None  # overrides model rates: Zipf popularity in listed order
    duration_s: float | None = None
    num_requests: int | None = None
    seed: int = 0
    prompt_scale: float = 1.0
    output_scale: float = 1.0

    def model_shares(self, models: list[ModelConfig]) -> list[float]:
        """Fraction of the total request rate going to each model, in list order (sums to 1).

        With `zipf_alpha` the model at list position k (0-based) gets weight 1/(k+1)^alpha;
        the loader already wrote these shares into each `ModelConfig.rate` (`write_zipf_rates`)."""
        if self.zipf_alpha is not None:
            try:
                weights = [1.0 / (rank + 1) ** self.zipf_alpha for rank in range(len(models))]
            except OverflowError:
                weights = [0.0]
            if weights[-1] == 0.0:
                raise ConfigError("workload.zipf_alpha", f"{self.zipf_alpha:g} leaves {models[-1].name!r} (and maybe others) "
                                  "no requests at all (its share underflows to 0); use a smaller exponent")
        else:
            weights = [m.rate for m in models]
        total = sum(weights)
        return [w / total for w in weights]

    def write_zipf_rates(self, models: list[ModelConfig]) -> None:
        """Set each model's rate to its Zipf share (the rates the planner reads)."""
        for m, share in zip(models, self.model_shares(models)):
            m.rate = share


def parse_workload(raw, base_dir: str) -> WorkloadConfig:
    s = Section(raw, "workload", tuple(WorkloadConfig.__dataclass_fields__))
    arrival = s.str("arrival", "poisson", choices=ARRIVALS)
    trace = s.str("trace")
    if trace is not None:
        trace = resolve_path(trace, base_dir)
        if not os.path.isfile(trace):
            raise ConfigError("workload.trace", f"{trace} does not exist")
    elif arrival == "trace":
        raise ConfigError("workload.trace", "arrival: trace needs a CSV path (arrived_at,num_prefill_tokens,num_decode_tokens)")
    return WorkloadConfig(
        arrival=arrival,
        cv=s.num("cv", 2.0, positive=True),
        trace=trace,
        rate=s.num("rate", positive=True),
        zipf_alpha=s.num("zipf_alpha", positive=True),
        duration_s=s.num("duration_s", positive=True),
        num_requests=s.int("num_requests", minimum=1),
        seed=s.int("seed", 0, minimum=0),
        prompt_scale=s.num("prompt_scale", 1.0, positive=True),
        output_scale=s.num("output_scale", 1.0, positive=True),
    )
