"""The Ray engine handles: one engine actor per engine of the placement.

Place in the data flow: `paraflex.serving.ray_startup.start_cluster` creates the actors
(paraflex.engine.ray_engine) and the `OutputRouter`; `RayEngines` holds them with the process
groups of the replicas (paraflex.engine.transport.ray) and the rendezvous store. The serving
frontend (paraflex/serving/frontend.py) reaches the engines through `add_request` and `free`
(the `EngineHandles` interface, paraflex/serving/engine_handle.py): msgpack actor calls that
return at once. `connect` builds the process groups at start-up, `rejoin` rebuilds those of a
restarted engine's replicas (next generation), `join_replica` / `leave_replica` build and drop
the group of a replica a live placement change adds or removes (paraflex/serving/ray_stages.py),
and `stop` ends every actor. A group's replica number names its rendezvous keys, so a replica
added live gets a number never used before (never a removed one's).
"""

from __future__ import annotations

import os

import msgpack
import ray

from paraflex.engine.transport.ray import GroupSpec


class RayEngines:
    """`EngineHandles` over engine actors (see the module docstring)."""

    def __init__(self, placement, actors: dict, router, store, store_host: str, store_port: int,
                 nodes=None) -> None:
        self.actors = actors  # engine id -> actor handle
        self.nodes = nodes  # the engines' placement groups and nodes (paraflex.serving.ray_nodes)
        self.router = router
        self._store = store
        self._store_addr = (store_host, store_port)
        self.groups = {(m, j): GroupSpec(m, j, tuple(engines))
                       for m, mp in placement.models.items() for j, engines in enumerate(mp.replicas)
                       if len(engines) > 1}
        self._next_group = {m: len(mp.replicas) for m, mp in placement.models.items()}

    # ------------------------------------------------------------------ EngineHandles
    def add_request(self, engine: int, model: str, engine_rid: str, prompt: list[int], params) -> None:
        self.actors[engine].add_request.remote(
            msgpack.packb([model, engine_rid, prompt, params.to_dict()], use_bin_type=True))

    def free(self, engine: int, model: str, engine_rids: list[str]) -> None:
        self.actors[engine].abort.remote(msgpack.packb([model, list(engine_rids)], use_bin_type=True))

    # ------------------------------------------------------------------ process groups
    def connect(self, timeout_s: float) -> int:
        """Build every replica's process group on every actor; returns how many groups."""
        wire = [g.to_wire() for g in self.groups.values()]
        ray.get([a.connect.remote(self.actors, wire, *self._store_addr) for a in self.actors.values()],
                timeout=timeout_s)
        return len(wire)

    def rejoin(self, engine: int, timeout_s: float) -> None:
        """`engine` restarted: rebuild the process groups of its replicas (next generation) on
        their members. Raises what Ray raises when a member cannot connect."""
        bumped = []
        for key, g in self.groups.items():
            if engine in g.engines:
                self.groups[key] = GroupSpec(g.model, g.replica, g.engines, g.generation + 1)
                bumped.append(self.groups[key])
        members = sorted({m for g in bumped for m in g.engines} | {engine})
        wire = [g.to_wire() for g in bumped]
        ray.get([self.actors[m].connect.remote(self.actors, wire, *self._store_addr) for m in members],
                timeout=timeout_s)

    def join_replica(self, model: str, engines: list[int], timeout_s: float) -> None:
        """Build the process group of `model`'s new replica on `engines` (one engine: none)."""
        if len(engines) < 2:
            return
        number = self._next_group[model]
        self._next_group[model] = number + 1
        spec = GroupSpec(model, number, tuple(engines))
        ray.get([self.actors[e].connect.remote(self.actors, [spec.to_wire()], *self._store_addr) for e in engines],
                timeout=timeout_s)
        self.groups[(model, number)] = spec

    def leave_replica(self, model: str, engines: list[int], live: list[int], timeout_s: float) -> None:
        """Drop the process group of `model`'s removed replica on `engines`, on its `live` members."""
        for key, spec in list(self.groups.items()):
            if key[0] == model and spec.engines == tuple(engines):
                del self.groups[key]
        ray.get([self.actors[e].leave_group.remote(model, list(engines)) for e in live], timeout=timeout_s)

    # ------------------------------------------------------------------ step logs
    def start_step_logs(self, directory: str, timeout_s: float = 30.0) -> list[str]:
        """Every engine logs the batches it runs under `directory` (engine/step_log.py); the paths."""
        return ray.get([a.start_step_log.remote(os.path.abspath(directory)) for a in self.actors.values()],
                       timeout=timeout_s)

    # ------------------------------------------------------------------ shutdown
    def stop(self, timeout_s: float) -> None:
        """Stop every actor (waiting up to `timeout_s`), then kill them and the router."""
        refs = [a.stop.remote() for a in self.actors.values()]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        finally:
            for a in list(self.actors.values()) + [self.router]:
                ray.kill(a, no_restart=True)
            if self.nodes is not None:
                self.nodes.release()
            self._store = None
