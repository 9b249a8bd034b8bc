"""Scheduling policies by name: the order in which an engine's scheduler tries its queues.

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) holds one policy object and
calls `policy.pick(sched, now)` once per decision (after the starvation promotion). A policy
only orders candidates; forming batches, KV and swapping stay in the scheduler's batch formers
(`sched.first_stage.decode` / `prefill`, `sched.later_stage.run_oldest`), so every policy obeys
the same KV rules. One file per policy; `get_policy(name)` and `POLICIES` are the registry.
"""

from __future__ import annotations

from paraflex.errors import ConfigError
from paraflex.engine.core.policies.base import ExactReplay, Policy
from paraflex.engine.core.policies.full_batch_first import FullBatchFirst
from paraflex.engine.core.policies.pipeline_first import PipelineFirst
from paraflex.engine.core.policies.prefill_first import PrefillFirst
from paraflex.engine.core.policies.sarathi import Sarathi

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FullBatchFirst, PipelineFirst, PrefillFirst, Sarathi)}


def get_policy(name: str) -> Policy:
    """A fresh policy object for `name`; ConfigError listing the known names otherwise."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError("scheduler.policy", f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return cls()


__all__ = ["POLICIES", "ExactReplay", "Policy", "get_policy"]
