"""The in-flight bound on a pipeline's decode batches (`scheduler.decode_batches_in_flight`).

Place in the data flow: `EngineScheduler` parses the setting once (`parse_inflight_limit`);
the full-batch-first policy (engine/core/policies/full_batch_first.py) asks `holds_back(limit,
st)` before a first stage forms an under-sized decode batch; full batches (`max_batch_size`
ready requests) are never held back, and one-stage models are never bounded.

Why (measured, docs/engine-core.md "Decode batches in flight"): the paper's full-batch-first
rule runs an under-sized decode batch whenever nothing else is runnable, and a later stage runs
the batches exactly as the first stage formed them. When a model's first stage sits on a
lightly loaded engine and a later stage on a loaded one (llama-2-70b's stage 0 alone on an
engine, stages 1-2 beside internlm replicas in the base case under balanced popularity), the
first stage re-forms every group of requests whose tokens come back as its own batch at once,
so batches never merge: at 56 req/s llama-2-70b ran 31,000 decode batches of 2.1-2.4 requests
on every stage, 75% of the shared engines' time, each costing as much as a batch of 64 (a
decode step reads the stage's weights whatever the batch). The work per token grows with the
number of fragments, which grows with load: throughput fell from 12 to 7 req/s as the offered
load rose. Sarathi's and vLLM's pipelines bound the micro-batches in flight to the stage count;
with the same bound the requests whose tokens return while S batches are in flight wait at the
first stage and leave together in the next batch.

Values: ``stages`` (default: S decode batches in flight for an S-stage model), ``Nx`` (N x S),
a positive integer N (N batches whatever S), ``unbounded`` (the paper's rule; the ablation
`--unbounded-decode-batches`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paraflex.errors import ConfigError

FIELD = "scheduler.decode_batches_in_flight"


@dataclass(frozen=True)
class InflightLimit:
    """At most `per_stage` x S (or `absolute`) decode batches of an S-stage model in flight."""

    per_stage: int | None = None
    absolute: int | None = None

    def cap(self, num_stages: int) -> int:
        return self.absolute if self.absolute is not None else self.per_stage * num_stages

    def __str__(self) -> str:
        if self.absolute is not None:
            return str(self.absolute)
        return "stages" if self.per_stage == 1 else f"{self.per_stage}x"


def parse_inflight_limit(value) -> InflightLimit | None:
    """None (unbounded: the paper's rule) or the bound; ConfigError naming the field otherwise."""
    if value is None or isinstance(value, InflightLimit):
        return value
    if isinstance(value, bool):
        raise ConfigError(FIELD, f"must be 'stages', 'Nx', a positive integer or 'unbounded' (got {value!r})")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(FIELD, f"must be >= 1 batch (got {value}); 'unbounded' turns the bound off")
        return InflightLimit(absolute=value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("unbounded", "none", "off", "paper"):
            return None
        if v == "stages":
            return InflightLimit(per_stage=1)
        if v.endswith("x") and v[:-1].isdigit() and int(v[:-1]) >= 1:
            return InflightLimit(per_stage=int(v[:-1]))
        if v.isdigit() and int(v) >= 1:
            return InflightLimit(absolute=int(v))
    raise ConfigError(FIELD, f"must be 'stages', 'Nx' (N x the stage count), a positive integer or 'unbounded' (got {value!r})")


def holds_back(limit: InflightLimit | None, stage) -> bool:
    """Whether the first stage `stage` (a ResidentStage) of a multi-stage model already has as
    many decode batches in flight as `limit` allows: then an under-sized decode batch waits and
    the requests whose tokens come back meanwhile join it. Always False for one-stage models
    and with the bound off (None: the paper's unbounded rule)."""
    if limit is None or stage.num_stages == 1:
        return False
    return len(stage.decode_inflight) >= limit.cap(stage.num_stages)


def config_value(limit: InflightLimit | None) -> str | int:
    """The config spelling of a parsed bound (for `Config.to_dict`)."""
    if limit is None:
        return "unbounded"
    return limit.absolute if limit.absolute is not None else str(limit)
