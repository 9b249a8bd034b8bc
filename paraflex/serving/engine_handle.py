"""The engine-handle interface: how the serving frontend reaches the engines of a placement.

Place in the data flow: the frontend (paraflex/serving/frontend.py) decides what happens to a
request; an `EngineHandles` carries its two commands to the engines: submit a request at the
first stage of a replica, and free requests' KV on one engine. Two implementations:
`InProcessEngines` (paraflex/serving/in_process_engines.py: `EngineLoop`s in this process,
stepped by `LLMCluster`) and `RayEngines` (paraflex/serving/ray_engines.py: one engine actor per
engine). Outputs travel the other way, from the last stages to `Frontend.on_output` (in
process: the engines' sink; on Ray: the output router, drained by `RayBackend`).

The frontend calls both commands with its lock held, so that a restart reaches an engine before
a later free of it: they must return at once and never call back into the frontend (an engine
that refuses a request ends it later, with an output record).
"""

from __future__ import annotations

from typing import Protocol


class EngineHandles(Protocol):
    """The engines of one placement, addressed by engine id."""

    def add_request(self, engine: int, model: str, engine_rid: str, prompt: list[int], params) -> None:
        """Submit a request (`params`: a SamplingParams) at `engine`, the first stage of one of
        `model`'s replicas. An engine that refuses it (e.g. an id it saw before) ends it with an
        "abort" output naming why."""

    def free(self, engine: int, model: str, engine_rids: list[str]) -> None:
        """Free these requests' KV on `engine`, as an abort (idempotent; unknown ids too)."""
