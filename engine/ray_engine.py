"""The engine actor: one Ray actor per engine of the placement (paper §6.3, §7).

Data flow: `paraflex.serving.ray_startup.start_cluster` creates one `EngineActor` per placement engine (a
CPU share, or one GPU). On start-up the actor loads only its resident stages on a loader thread
(`status()` reports the progress lines), then runs stage-exec's `EngineLoop` on the engine
thread. Work arrives three ways, all as actor calls with msgpack bytes:
  - `add_request` (from the gateway's backend, at a model's first stage);
  - `deliver` (phase 1 of a hop from another engine; paraflex.engine.transport.ray);
  - `abort` (the backend frees a request on every engine of its replica).
A live placement change (paraflex/serving/ray_stages.py) adds a stage with `load_stage` (its
weights load on a thread, then it joins the loop between two steps) and drops one with
`unload_stage` (between two steps); both return at once and `stage_change(model)` reports
"done" or "failed: ..."; `leave_group` drops a removed replica's process group.
The loop sends batches to the next stage through the `RayTransport`, the last stage's token
back to the first stage as metadata only, and the token stream to the gateway through the
`OutputRouter` (paraflex.engine.ray_output). A finished or aborted request's KV is freed on
every stage by the loop's free messages.

With `start_step_log(DIR)` (`paraflex serve --step-log DIR`) the engine thread logs every loop
iteration that ran a batch to DIR/engine-<id>.csv (engine/step_log.py).

Actor methods never block for long: a sync actor runs `deliver` only between other calls, so
loading happens on a thread and the engine loop runs on its own thread.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import uuid

import msgpack
import ray
import torch

from paraflex.engine.core.messages import FreeMessage
from paraflex.engine.ray_output import BatchingSink
from paraflex.engine.core.request import WAITING_PREFILL
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.engine.kernels import omp_policy
from paraflex.engine.step_log import FLUSH_EVERY_S, StepLog, step_clock
from paraflex.engine.transport.base import Envelope
from paraflex.engine.transport.ray import GroupSpec, RayTransport
from paraflex.errors import ParaflexError

LOADING, READY, FAILED, STOPPED = "loading", "ready", "failed", "stopped"
STATS_EVERY_S = FLUSH_EVERY_S  # how often the engine thread refreshes the numbers status() reports (and flushes)


class EngineActor:
    """One execution engine. Wrapped with `ray.remote(...)` options by paraflex.serving.ray_startup."""

    def __init__(self, engine_id: int, config, placement, router, *, device: str = "auto",
                 dtype: str = "auto", kv_bytes: int | None = None, seed: int = 0,
                 num_threads: int = 1) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]  # changes when Ray restarts the actor
        self.state = LOADING
        self.error: str | None = None
        self.progress: list[str] = []
        self.loop = None
        self.sink = BatchingSink(router)
        device = "cuda:0" if device == "auto" and torch.cuda.is_available() else device
        self.transport = RayTransport(engine_id, "cpu" if device == "auto" else device,
                                      on_error=self._transport_error)
        self._stats: dict = {}
        self.torch_threads: int | None = None  # torch's intra-op threads on the engine thread, once it runs
        self._inbox: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._engine_thread: threading.Thread | None = None
        self._build_args = (config, placement, device, dtype, kv_bytes, seed)
        self._changes: dict[str, str] = {}  # model -> its live stage change: "loading", "done", "failed: ..."
        self.step_log = None  # a StepLog once `start_step_log` (paraflex serve --step-log)
        threading.Thread(target=self._load, name="pf-load", daemon=True).start()

    # ------------------------------------------------------------------ start-up
    def _say(self, line: str) -> None:
        self.progress.append(line)

    def _load(self) -> None:
        from paraflex.engine.engine_builder import build_engine
        from paraflex.engine.gc_heap import freeze_start_up_heap

        config, placement, device, dtype, kv_bytes, seed = self._build_args
        try:
            t0 = time.monotonic()
            self.loop = build_engine(config, placement, self.engine_id, self.transport, self.sink,
                                     device=device, dtype=dtype, kv_bytes=kv_bytes, seed=seed,
                                     progress=self._say)
            self._say(f"engine {self.engine_id}: ready in {time.monotonic() - t0:.1f} s "
                      f"(pid {os.getpid()})")
            freeze_start_up_heap()  # engine/gc_heap.py: collections skip what start-up built
            self.state = READY
            self._engine_thread = threading.Thread(target=self._run, name="pf-engine", daemon=True)
            self._engine_thread.start()
        except Exception as exc:  # noqa: BLE001 - reported through status()
            self.error = f"{type(exc).__name__}: {exc}"
            self._say(f"engine {self.engine_id}: failed to load: {self.error}")
            self.state = FAILED

    # ------------------------------------------------------------------ control (actor calls)
    def status(self) -> dict:
        """Liveness, start-up progress and the numbers behind /metrics (cheap)."""
        out = {"engine": self.engine_id, "state": self.state, "incarnation": self.incarnation,
               "pid": os.getpid(), "progress": list(self.progress), "error": self.error,
               "groups": self.transport.group_generations(), "transport_errors": len(self.transport.errors),
               "torch_threads": self.torch_threads, "omp_wait_policy": os.environ.get(omp_policy.VARIABLE)}
        out.update(self._stats)
        if self.loop is not None:  # batches started/finished per model, now (the KV-stall watch)
            out["runs"] = self.loop.run_counts()
            out["kv_token_limits"] = self.loop.scheduler.kv_token_limits()  # admission.check_kv_fit
        return out

    def _snapshot(self) -> None:
        """Scheduler numbers for status(), taken on the engine thread (no racing reads)."""
        sched = self.loop.scheduler
        cap = sched.pool.capacity
        waiting: dict[str, int] = {}
        live: dict[str, int] = {}
        for r in sched.live_requests():
            live[r.model] = live.get(r.model, 0) + 1
            if r.state == WAITING_PREFILL and r.stage == 0:
                waiting[r.model] = waiting.get(r.model, 0) + 1
        self._stats = {"kv_usage": sched.pool.num_used / cap if cap else 0.0,
                       "live": live, "waiting": waiting,
                       "swaps": sched.kv.swap_totals(), "swapped": sched.kv.swapped_ids()}

    def connect(self, peers: dict, groups: list, store_host: str, store_port: int) -> dict:
        """Peer handles and this engine's process groups (all members call at once)."""
        self.transport.connect(peers, [GroupSpec.from_wire(g) for g in groups], store_host, store_port)
        return self.transport.group_generations()

    def deliver(self, payload: bytes) -> None:
        self.transport.deliver(payload)

    def add_request(self, payload: bytes) -> None:
        """msgpack [model, request_id, prompt_token_ids, sampling params dict]."""
        model, rid, prompt, sampling = msgpack.unpackb(payload, raw=False)
        self._post(("add", model, rid, prompt, sampling))

    def abort(self, payload: bytes) -> None:
        """msgpack [model, [request ids]]: free their KV here (idempotent)."""
        model, rids = msgpack.unpackb(payload, raw=False)
        self._post(("free", model, rids))

    def load_stage(self, model: str, stage: int, layers: list, num_stages: int, route: list) -> None:
        """Start loading stage `stage` (layers [a, b)) of `model` on a thread; it joins the engine
        loop between two steps, serving on the replica `route` (see `stage_change`)."""
        self._changes[model] = "loading"
        threading.Thread(target=self._load_stage, args=(model, stage, tuple(layers), num_stages, list(route)),
                         name="pf-stage-load", daemon=True).start()

    def unload_stage(self, model: str) -> None:
        """Drop `model`'s stage between two steps (weights, KV, leftover requests)."""
        self._changes[model] = "unloading"
        self._post(("call", model, lambda: self.loop.remove_stage(model)))

    def stage_change(self, model: str) -> str | None:
        """The state of `model`'s last stage change here: "loading", "unloading", "done", "failed: ..."
        (also when the engine loop died: the change can never be applied then)."""
        state = self._changes.get(model)
        if state in ("loading", "unloading") and self.state == FAILED:
            return f"failed: {self.error}"
        return state

    def leave_group(self, model: str, engines: list) -> None:
        """Drop the process group of `model`'s replica on `engines` (a removed replica)."""
        self.transport.leave(model, tuple(engines))

    def _load_stage(self, model: str, stage: int, layers: tuple, num_stages: int, route: list) -> None:
        from paraflex.engine.engine_builder import load_stage

        config, _, device, dtype, _, _ = self._build_args
        try:
            loaded = load_stage(config, model, stage, layers, num_stages, device, dtype, self.engine_id)
        except Exception as exc:  # noqa: BLE001 - reported through stage_change
            self._changes[model] = f"failed: {type(exc).__name__}: {exc}"
            return
        self._post(("call", model, lambda: self.loop.add_stage(model, stage, num_stages, route, *loaded)))

    def start_step_log(self, directory: str) -> str:
        """Log every batch this engine runs to DIR/engine-<id>.csv (engine/step_log.py); its path."""
        self.step_log = StepLog(directory, self.engine_id)
        return self.step_log.path

    def stop(self) -> None:
        self._stop.set()
        self.transport.notify()
        if self._engine_thread is not None:
            self._engine_thread.join(5.0)
        self.transport.close()
        self.sink.close()
        if self.step_log is not None:
            self.step_log.close()
        self.state = STOPPED

    # ------------------------------------------------------------------ the engine thread
    def _post(self, item: tuple) -> None:
        with self._lock:
            self._inbox.append(item)
        self.transport.notify()

    def _apply_inbox(self) -> bool:
        with self._lock:
            items, self._inbox = self._inbox, []
        for item in items:
            if item[0] == "call":  # a live stage change, between two steps
                _, model, fn = item
                try:
                    fn()
                    self._changes[model] = "done"
                except Exception as exc:  # noqa: BLE001 - reported through stage_change
                    self._changes[model] = f"failed: {type(exc).__name__}: {exc}"
            elif item[0] == "add":
                _, model, rid, prompt, sampling = item
                try:
                    self.loop.add_request(model, rid, prompt, SamplingParams.from_dict(sampling))
                except ParaflexError as exc:  # refused (e.g. an id used before): it ends, the engine goes on
                    self.sink.on_output(rid, [], "abort", f"engine {self.engine_id} refused the request: {exc}")
            else:
                _, model, rids = item
                meta = FreeMessage(model, list(rids), "aborted").to_dict()
                self.loop.handle(Envelope(self.engine_id, self.engine_id, model, "free", meta))
        return bool(items)

    def _run(self) -> None:
        self.torch_threads = torch.get_num_threads()
        try:
            last = 0.0
            while not self._stop.is_set():
                clock = step_clock()
                worked = self._apply_inbox()
                ran = self.loop.step()
                worked |= ran
                if ran and self.step_log is not None:
                    self.step_log.record_last_run(self.loop, clock)
                now = time.monotonic()
                if now - last > STATS_EVERY_S:
                    self._snapshot()
                    if self.step_log is not None:
                        self.step_log.flush()
                    last = now
                if not worked and not self.loop.has_work():
                    self.transport.wait(STATS_EVERY_S)
        except Exception as exc:  # noqa: BLE001 - the controller sees FAILED and fails requests
            self.error = f"engine loop: {type(exc).__name__}: {exc}"
            self._say(f"engine {self.engine_id}: {self.error}\n{traceback.format_exc()}")
            self.state = FAILED

    def _transport_error(self, model: str, peer: int, exc: BaseException) -> None:
        self._say(f"engine {self.engine_id}: transfer of {model} with engine {peer} failed: {exc}")


def engine_actor_class(num_cpus: float, num_gpus: float, max_restarts: int):
    """`EngineActor` as a Ray actor class with this cluster's resources and restart policy, its
    process's OpenMP threads sleeping between regions (paraflex.engine.kernels.omp_policy)."""
    env = {omp_policy.VARIABLE: omp_policy.engine_wait_policy()}
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts,
                      max_task_retries=0, runtime_env={"env_vars": env})(EngineActor)
