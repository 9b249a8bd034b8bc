"""A Backend over the in-process runtime: every engine in this process, on one thread.

Data flow: the gateway calls `stream(...)` on its event loop; this submits the request to
`paraflex.serving.in_process.LLMCluster`, whose serving frontend (paraflex/serving/frontend.py)
dispatches it to the least-loaded replica while the cluster steps all engines on its background
thread. The request's `StreamSink` (paraflex/serving/stream_sink.py) hands each output from
that thread to the request's asyncio queue, and `stream` yields it to the gateway. `abort` asks
the cluster to free the request's KV on every stage; the cluster then ends the stream with
finish_reason "abort". `change_placement` applies a new placement live
(paraflex/serving/live_placement.py over paraflex/serving/in_process_stages.py). Used by `paraflex serve --in-process`, the gateway's end-to-end tests
and the load benchmark; the Ray backend (paraflex/serving/ray_backend.py) runs the same frontend
over engine actors.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import AsyncIterator

from paraflex.serving.backend import BackendMetrics, ModelCard, Output, count_swapped
from paraflex.serving.in_process_stages import InProcessStages
from paraflex.serving.live_placement import PlacementChanger
from paraflex.serving.stream_sink import StreamSink


# The engine thread releases the GIL inside every torch op and needs it back between ops; with
# the gateway's thread streaming tokens in the same process, CPython's default 5 ms switch
# interval lets the gateway keep the GIL that long while the engine waits. At 0.5 ms, SmolLM2
# served at batch 32 on the 2-core VM: 113-114 tok/s (TPOT 208-211 ms) vs 94-103 (268-304 ms),
# two interleaved pairs of runs (`bench/serve_load.py --peer-batches 32`).
GIL_SWITCH_INTERVAL_S = 0.0005


class InProcessBackend:
    """Backend protocol over an `LLMCluster` running on its background thread."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._cards = [ModelCard(m, cluster.max_model_len(m), cluster.tokenizer(m))
                       for m in cluster.models()]
        self._live: dict[str, str] = {}  # request id -> model, for requests this backend streams
        self._lock = threading.Lock()
        self.changer = PlacementChanger(cluster.config, cluster.frontend, InProcessStages(cluster))
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        cluster.start()

    @classmethod
    def start(cls, config, placement=None, **cluster_kwargs) -> "InProcessBackend":
        """Build the engines of `placement` (planned when None), printing progress."""
        from paraflex.serving.in_process import LLMCluster

        cluster_kwargs.setdefault("progress", lambda line: print(line, flush=True))
        return cls(LLMCluster(config, placement, **cluster_kwargs))

    @property
    def frontend(self):
        """The serving frontend of the cluster (paraflex/serving/frontend.py)."""
        return self.cluster.frontend

    def models(self) -> list[ModelCard]:
        return list(self._cards)

    async def stream(self, model: str, prompt_token_ids: list[int], params,
                     request_id: str) -> AsyncIterator[Output]:
        sink = StreamSink(asyncio.get_running_loop())
        log = self.cluster.frontend.request_log
        if log is not None:
            log.awaiting(request_id)  # the loop thread starts it, outside this request's context
        try:
            self.cluster.submit(model, prompt_token_ids, params, request_id, sink)  # UserError: rejected
        except Exception:
            if log is not None:
                log.dropped(request_id)
            raise
        with self._lock:
            self._live[request_id] = model
        try:
            while True:
                out = await sink.queue.get()
                yield out
                if out.final:
                    return
        finally:
            with self._lock:
                self._live.pop(request_id, None)

    async def abort(self, request_id: str, error: str | None = None) -> None:
        self.cluster.abort(request_id, error)

    def placement(self):
        return self.changer.placement()

    def change_placement(self, placement, source: str = "placement") -> dict:
        return self.changer.apply(placement, source)

    def health(self) -> dict:
        error = self.cluster.loop_error
        engines = {str(e.engine_id): "failed" if error else "alive" for e in self.cluster.engines}
        state = {"ok": error is None, "backend": "in-process", "engines": engines}
        if error is not None:
            state["error"] = f"{type(error).__name__}: {error}"
        return state

    def metrics(self) -> BackendMetrics:
        with self._lock:
            live = list(self._live.values())
        waiting = {m: 0 for m in self.cluster.models()}
        usage, swaps, swapped = {}, {}, []
        for engine in self.cluster.engines:
            sched = engine.scheduler
            usage[engine.engine_id] = sched.pool.num_used / sched.pool.capacity if sched.pool.capacity else 0.0
            swaps[engine.engine_id] = sched.kv.swap_totals()
            swapped.append(sched.kv.swapped_ids())
            for stage in sched.stages:
                if stage.is_first:
                    waiting[stage.model] += len(stage.prefill_q)
        running = {m: max(0, live.count(m) - waiting[m]) for m in waiting}
        for m, n in self.cluster.held().items():  # stopped to free KV, waiting for a restart
            running[m] = max(0, running[m] - n)
            waiting[m] += n
        return BackendMetrics(running=running, waiting=waiting, kv_cache_usage=usage,
                              preemptions=self.cluster.frontend.preemptions(),
                              swapped=count_swapped(swapped), swaps=swaps,
                              placement_actions=dict(self.changer.counters.actions),
                              placement_moved_bytes=self.changer.counters.moved_bytes)

    def start_step_logs(self, directory: str) -> list[str]:
        """Every engine logs the batches it runs under `directory` (`serve --step-log`); the paths.
        Started on the loop thread, between steps."""
        return self.cluster.call_on_loop(lambda: self.cluster.engine_handles.start_step_logs(directory))

    async def close(self) -> None:
        await asyncio.to_thread(self.cluster.shutdown)
