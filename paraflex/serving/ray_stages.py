"""Stages joining and leaving the Ray engine actors while they serve (live re-planning).

Place in the data flow: the placement changer (paraflex/serving/live_placement.py) applies a
change through a `StageControl` (the protocol there); this is the one over `RayEngines`
(paraflex/serving/ray_engines.py). `load_stage` asks the engine actor to load the stage
(paraflex/engine/ray_engine.py: its weights load on a thread of the actor while its engine loop
keeps serving, then the stage joins the loop between two steps, its KV from the engine's shared
pool) and polls `stage_change` until it is done; `unload_stage` likewise drops it.
`join_replica` builds the new replica's process group on its engines; `leave_replica` drops a
removed one's, so no later hop of the model reaches it.
"""

from __future__ import annotations

import time

import ray

from paraflex.errors import ParaflexError

POLL_S = 0.05
STAGE_TIMEOUT_S = 600.0  # loading a large stage from disk
CALL_TIMEOUT_S = 120.0


class RayStages:
    """`StageControl` over engine actors; `statuses()` gives each engine's last status (the
    monitor's)."""

    def __init__(self, engines, statuses) -> None:
        self.engines = engines
        self.statuses = statuses

    def cannot_host(self, engine: int) -> str | None:
        state = self.statuses().get(engine, {}).get("state")
        if engine not in self.engines.actors or state != "ready":
            return f"engine {engine} is not serving (state {state})"
        return None

    def load_stage(self, engine: int, model: str, stage: int, layers: tuple[int, int], num_stages: int,
                   route: list[int]) -> None:
        actor = self.engines.actors[engine]
        ray.get(actor.load_stage.remote(model, stage, list(layers), num_stages, list(route)), timeout=CALL_TIMEOUT_S)
        self._wait(engine, model, f"load {model} stage {stage}")

    def unload_stage(self, engine: int, model: str) -> None:
        ray.get(self.engines.actors[engine].unload_stage.remote(model), timeout=CALL_TIMEOUT_S)
        self._wait(engine, model, f"drop {model}'s stage")

    def join_replica(self, model: str, engines: list[int]) -> None:
        self.engines.join_replica(model, engines, CALL_TIMEOUT_S)

    def leave_replica(self, model: str, engines: list[int]) -> None:
        live = [e for e in engines if self.cannot_host(e) is None]
        self.engines.leave_replica(model, engines, live, CALL_TIMEOUT_S)

    def kv_token_limits(self) -> dict[int, dict[str, tuple[int, int]]]:
        refs = {e: a.status.remote() for e, a in self.engines.actors.items()}
        out = {}
        for e, ref in refs.items():
            st = ray.get(ref, timeout=CALL_TIMEOUT_S)
            if "kv_token_limits" in st:
                out[e] = st["kv_token_limits"]
        return out

    def _wait(self, engine: int, model: str, what: str) -> None:
        actor = self.engines.actors[engine]
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while True:
            state = ray.get(actor.stage_change.remote(model), timeout=CALL_TIMEOUT_S)
            if state == "done":
                return
            if state is None or state.startswith("failed"):
                raise ParaflexError(f"engine {engine} could not {what}: {state}")
            if time.monotonic() > deadline:
                raise ParaflexError(f"engine {engine} did not {what} within {STAGE_TIMEOUT_S:g} s")
            time.sleep(POLL_S)
