"""Stages joining and leaving the in-process engines while they serve (live re-planning).

Place in the data flow: the placement changer (paraflex/serving/live_placement.py) applies a
change through a `StageControl` (the protocol there); this is the one over an `LLMCluster`
(paraflex/serving/in_process.py). A stage's weights load on the calling thread (the changer's),
from the checkpoint on disk (`engine_builder.load_stage`), while the cluster's thread keeps
stepping every engine; the loaded stage then joins its engine's `EngineLoop` on that thread
between two steps (`LLMCluster.call_on_loop`), taking its KV from the engine's shared pool's
free blocks. Leaving runs there too: `EngineLoop.remove_stage` drops the weights, route and any
leftover request of the model (their KV back to the pool). The engines of one process share one
transport, so a replica needs no process group (`join_replica` / `leave_replica` do nothing).
"""

from __future__ import annotations

from paraflex.engine.engine_builder import load_stage


class InProcessStages:
    """`StageControl` over the engines of an `LLMCluster`."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def cannot_host(self, engine: int) -> str | None:
        """Why `engine` cannot take a stage now, or None."""
        if self.cluster.loop_error is not None:
            return "the in-process engines stopped after an internal error"
        if self.cluster.engine_handles.loop_of(engine) is None:
            return (f"engine {engine} holds no stage and runs no engine loop in this server (its KV pool was "
                    "never sized); restart the server with a placement that uses it")
        return None

    def load_stage(self, engine: int, model: str, stage: int, layers: tuple[int, int], num_stages: int,
                   route: list[int]) -> None:
        loop = self.cluster.engine_handles.loop_of(engine)
        tokenizer = self.cluster.tokenizer(model) if stage == num_stages - 1 else None
        loaded = load_stage(self.cluster.config, model, stage, layers, num_stages, self.cluster.device,
                            self.cluster.dtype, engine, tokenizer=tokenizer)
        self.cluster.call_on_loop(lambda: loop.add_stage(model, stage, num_stages, route, *loaded))

    def unload_stage(self, engine: int, model: str) -> None:
        loop = self.cluster.engine_handles.loop_of(engine)
        self.cluster.call_on_loop(lambda: loop.remove_stage(model))

    def join_replica(self, model: str, engines: list[int]) -> None:
        """One transport in one process: nothing to connect."""

    def leave_replica(self, model: str, engines: list[int]) -> None:
        """One transport in one process: nothing to disconnect."""

    def kv_token_limits(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per engine: its scheduler's `kv_token_limits()`, read on the engines' thread."""
        return self.cluster.call_on_loop(self.cluster.engine_handles.kv_token_limits)
