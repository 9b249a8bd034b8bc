"""The gateway's Ray backend: requests in, tokens out, faults watched (the serving path of
`paraflex serve` once `paraflex.serving.ray_startup.start_cluster` has started the engine actors).

Data flow: the gateway calls `RayBackend.stream(...)`; the serving frontend
(paraflex/serving/frontend.py) admits the request, picks a live replica (the dispatch rule)
and submits it to the replica's first-stage actor through `RayEngines`
(paraflex/serving/ray_engines.py). Tokens come back from the last stage through the
`OutputRouter`, which a poller thread here drains into the frontend, which maps each record
to the client's request and its `StreamSink` (paraflex/serving/stream_sink.py). An
`EngineMonitor` thread (paraflex/serving/ray_monitor.py) watches the actors: a dead engine
fails its replicas' requests at once and leaves dispatch until Ray has restarted it and it has
rejoined; the KV-stall watch stops a request when a replica has stopped making progress, and it
restarts by recompute (paraflex/serving/recompute.py) under a new engine request id.
`placement()` answers the serving placement; `change_placement` applies a new one live through
the `PlacementChanger` (paraflex/serving/live_placement.py) over `RayStages`
(paraflex/serving/ray_stages.py: the actors load and drop stages between steps, replicas' process
groups are built and dropped).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from typing import AsyncIterator, Callable

import ray

from paraflex.engine.ray_output import unpack_records
from paraflex.engine.worker.tokenizer import load_tokenizer
from paraflex.serving.admission import kv_limits_by_model
from paraflex.serving.backend import BackendMetrics, ModelCard, Output, count_swapped
from paraflex.serving.frontend import Frontend
from paraflex.serving.live_placement import PlacementChanger
from paraflex.serving.ray_engines import RayEngines
from paraflex.serving.ray_monitor import MONITOR_EVERY_S, EngineMonitor
from paraflex.serving.ray_stages import RayStages
from paraflex.serving.stream_sink import StreamSink

ALIVE, DEAD = "alive", "dead"
STOP_TIMEOUT_S = 10


class RayBackend:
    """The gateway's `Backend` over engine actors (see the module docstring)."""

    def __init__(self, config, placement, engines: RayEngines, ray_dir: str | None,
                 progress: Callable[[str], None]) -> None:
        self.config = config
        self.engines = engines
        self._ray_dir = ray_dir  # set when this backend started the Ray instance
        self.progress = progress
        self.model_names = list(placement.models)  # fixed for the backend's lifetime
        self.frontend = Frontend(config, placement, engines, report=lambda line: progress(f"paraflex: {line}"))
        self.monitor = EngineMonitor(self.frontend, engines, progress)
        self.changer = PlacementChanger(config, self.frontend, RayStages(engines, self.monitor.statuses),
                                        report=lambda line: progress(f"paraflex: {line}"))
        self._cards: list[ModelCard] = []  # once the engines report their KV (start)
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self.monitor.run, args=(self._closed,), name="pf-monitor",
                                          daemon=True),
                         threading.Thread(target=self._poll_outputs, name="pf-outputs", daemon=True)]

    def start(self, statuses: dict[int, dict]) -> None:
        """Serve, given every engine's status at start-up (all ready)."""
        self.monitor.begin(statuses)
        self.frontend.kv_limits = kv_limits_by_model({e: st["kv_token_limits"] for e, st in statuses.items()})
        self._cards = [ModelCard(m, self.frontend.max_model_len(m), self._tokenizer(m)) for m in self.model_names]
        for t in self._threads:
            t.start()

    def _tokenizer(self, model: str):
        mc = self.config.model(model)
        return load_tokenizer(mc.source, mc.source_kind, model)

    # ------------------------------------------------------------------ Backend protocol
    def models(self) -> list[ModelCard]:
        return list(self._cards)

    async def stream(self, model: str, prompt_token_ids: list[int], params,
                     request_id: str) -> AsyncIterator[Output]:
        prompt, params = self.frontend.admit(model, prompt_token_ids, params)
        sink = StreamSink(asyncio.get_running_loop())
        self.frontend.start(request_id, model, prompt, params, sink)
        finished = False
        try:
            while True:
                out = await sink.queue.get()
                finished = out.final
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away: free the request everywhere
                self.frontend.end(request_id, notify=False)

    async def abort(self, request_id: str, error: str | None = None) -> None:
        self.frontend.end(request_id, error)

    def placement(self):
        return self.changer.placement()

    def change_placement(self, placement, source: str = "placement") -> dict:
        return self.changer.apply(placement, source)

    def health(self) -> dict:
        down = self.frontend.down_engines()
        engines = {str(e): DEAD if e in down else ALIVE for e in self.engines.actors}
        models = {m: {"replicas": len(mp.replicas), "live_replicas": self.frontend.live_replicas(m)}
                  for m, mp in self.placement().models.items()}
        out = {"ok": not down, "backend": "ray", "engines": engines, "models": models}
        if self.engines.nodes is not None:  # engine -> the Ray node it runs on
            out["nodes"] = {str(e): where for e, where in sorted(self.engines.nodes.node_of.items())}
        if down:
            out["errors"] = {str(e): why for e, why in down.items()}
        return out

    def metrics(self) -> BackendMetrics:
        live = self.frontend.running_by_model()
        held = self.frontend.held()  # waiting for a restart
        queued = {m: 0 for m in self.model_names}  # waiting in the engines
        usage, swaps, swapped = {}, {}, []
        for e, st in self.monitor.statuses().items():
            if "kv_usage" in st:
                usage[e] = float(st["kv_usage"])
            if "swaps" in st:
                swaps[e] = dict(st["swaps"])
            swapped.append(st.get("swapped", {}))
            for m, n in st.get("waiting", {}).items():
                queued[m] = queued.get(m, 0) + n
        running = {m: max(0, live.get(m, 0) - n) for m, n in queued.items()}
        waiting = {m: n + held.get(m, 0) for m, n in queued.items()}
        return BackendMetrics(running=running, waiting=waiting, kv_cache_usage=usage,
                              preemptions=self.frontend.preemptions(),
                              swapped=count_swapped(swapped), swaps=swaps,
                              placement_actions=dict(self.changer.counters.actions),
                              placement_moved_bytes=self.changer.counters.moved_bytes)

    def start_step_logs(self, directory: str) -> list[str]:
        """Every engine actor logs the batches it runs under `directory` (`serve --step-log`); the paths."""
        return self.engines.start_step_logs(directory)

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ outputs
    def _poll_outputs(self) -> None:
        """Drain the output router into the frontend (the poller thread's body)."""
        while not self._closed.is_set():
            try:
                payloads = ray.get(self.engines.router.take.remote(MONITOR_EVERY_S))
            except Exception as exc:  # noqa: BLE001 - the router died: nothing can stream
                if self._closed.is_set():
                    return
                self.frontend.fail_all(f"output router failed: {type(exc).__name__}: {exc}")
                return
            for payload in payloads:
                for engine_rid, tokens, finish, error in unpack_records(payload):
                    self.frontend.on_output(engine_rid, list(tokens), finish, error)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop every actor, the threads, and the Ray instance this backend started."""
        if self._closed.is_set():
            return
        self._closed.set()
        for t in self._threads:
            if t.is_alive():
                t.join(5.0)
        self.frontend.fail_all("server shutting down")
        try:
            self.engines.stop(STOP_TIMEOUT_S)
        finally:
            if self._ray_dir is not None:
                ray.shutdown()
                shutil.rmtree(self._ray_dir, ignore_errors=True)
