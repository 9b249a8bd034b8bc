"""What a simulated system is: a `SystemLayout` (placement, engine shape, policy), and the
registry of system builders by name.

layouts.py registers the ParaFlex paper's systems, simulator/seeds/layouts.py the seed systems;
runner.py builds the cluster a layout names (the ParaFlex pipeline cluster, or a seed system's
own through `seed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paraflex.placement import Placement
from paraflex.simulator.registry import Registry

SYSTEMS: Registry = Registry("system")


@dataclass
class SystemLayout:
    name: str
    placement: Placement
    policy: str
    gpus_per_engine: int
    memory_bytes: int  # per engine: weights + KV
    prefill_token_budget: int | None = None  # overrides scheduler.prefill_token_budget
    decode_batches_in_flight: str | int | None = None  # overrides scheduler.decode_batches_in_flight
    prefill_max_requests: int | None = None  # overrides the prompts per prefill batch (scheduler.pack_prompts)
    head_start_s: dict[str, float] | None = None  # overrides scheduler.head_start_s ({}: none)
    seed: object | None = None  # a seed system's SeedSpec (simulator/seeds/): its own simulated cluster

    def describe(self) -> dict:
        return {
            "system": self.name,
            "policy": self.policy,
            "planner": self.placement.planner,
            "engines": self.placement.num_engines,
            "gpus_per_engine": self.gpus_per_engine,
            "prefill_token_budget": self.prefill_token_budget,
            "decode_batches_in_flight": self.decode_batches_in_flight,
            "prefill_max_requests": self.prefill_max_requests,
            "head_start_s": self.head_start_s,
            "memory_bytes_per_engine": self.memory_bytes,
            "models": {name: {"stages": m.num_stages, "replicas": m.num_replicas} for name, m in self.placement.models.items()},
            **({"seed": self.seed.describe()} if self.seed is not None else {}),
        }
