"""The gateway's Ray backend: requests in, tokens out, faults watched (the serving path of
`paraflex serve` once `paraflex.serving.ray_startup.start_cluster` has started the engine actors).

Data flow: the gateway calls `RayBackend.stream(...)`: least-outstanding dispatch (engine-core's
`Dispatcher`) picks a live replica, the request goes to its first-stage actor as msgpack, and
tokens come back from the last stage through the `OutputRouter`, which a poller thread drains
into the per-request streams.

Faults: a monitor thread checks every actor in Ray's GCS and through its `status()`. An actor
that dies (or whose loop failed) ends every request on its replicas with an error at once
(within about a second; the issue asks for 10 s), frees those requests on the surviving engines
of the replica, and the replica leaves dispatch; `health()` reports it and other models keep
serving. With `max_restarts` > 0 Ray restarts the actor; once it has reloaded, the monitor
rebuilds the process groups of its replicas (next generation) and the replicas rejoin dispatch.
The same monitor hands each round's batch counts and live streams to the KV-stall watch
(paraflex/serving/kv_stall.py), which names requests to stop when a replica has stopped making progress:
each restarts by recompute (paraflex/serving/recompute.py) under a new engine request id, and the
output records are mapped back to the client's request id.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import msgpack
import ray

from paraflex.serving.admission import check_request, kv_limits_by_model, max_model_len
from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.engine.ray_engine import FAILED, READY
from paraflex.engine.ray_output import unpack_records
from paraflex.engine.worker.tokenizer import load_tokenizer
from paraflex.engine.transport.ray import GroupSpec
from paraflex.errors import UserError
from paraflex.serving.backend import BackendMetrics, ModelCard, Output, Unavailable
from paraflex.serving.kv_stall import StallWatch, live_by_replica
from paraflex.serving.recompute import Restartable, Restarts, held_by_model

MONITOR_EVERY_S = 0.5
ALIVE, DEAD = "alive", "dead"


@dataclass(kw_only=True)
class _Stream(Restartable):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RayBackend:
    """The gateway's `Backend` over engine actors (see the module docstring)."""

    def __init__(self, config, placement, actors: dict, router, store, store_host: str,
                 store_port: int, ray_dir: str | None, progress: Callable[[str], None]) -> None:
        self.config = config
        self.placement = placement
        self.actors = actors
        self.router = router
        self._store = store
        self._store_addr = (store_host, store_port)
        self._ray_dir = ray_dir  # set when this backend started the Ray instance
        self.progress = progress
        self.dispatcher = Dispatcher.from_placement(placement)
        self.groups = {(m, j): GroupSpec(m, j, tuple(engines))
                       for m, mp in placement.models.items() for j, engines in enumerate(mp.replicas)
                       if len(engines) > 1}
        self._cards: list[ModelCard] = []  # once the engines report their KV (start)
        self._kv_limits: dict[str, dict[int, tuple[int, int]]] = {}  # admission.kv_limits_by_model (start)
        self._streams: dict[str, _Stream] = {}  # by the client's request id, oldest first
        self.restarts = Restarts()  # engine request ids, stops per model (paraflex/serving/recompute.py)
        self._lock = threading.Lock()
        self.engine_state = {e: ALIVE for e in actors}
        self.engine_error: dict[int, str] = {}
        self._incarnation: dict[int, str] = {}
        self._restarts: dict[int, int] = {}  # Ray's restart count when last seen alive
        self._status: dict[int, dict] = {}
        self.stall_watch = StallWatch()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._monitor, name="pf-monitor", daemon=True),
                         threading.Thread(target=self._poll_outputs, name="pf-outputs", daemon=True)]

    def start(self, statuses: dict[int, dict]) -> None:
        for e, st in statuses.items():
            self._incarnation[e] = st["incarnation"]
            self._status[e] = st
        self._kv_limits = kv_limits_by_model({e: st["kv_token_limits"] for e, st in statuses.items()})
        self._cards = [ModelCard(m, max_model_len(self.config, self._kv_limits, m), self._tokenizer(m))
                       for m in self.placement.models]
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
        params = params.validate()
        prompt = check_request(self.config, self.placement, self._kv_limits, model, prompt_token_ids, params.max_tokens)
        stream = _Stream(model=model, replica=-1, prompt=prompt, params=params, engine_rid=request_id,
                         loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        with self._lock:
            if self.restarts.in_use(request_id, self._streams):
                raise UserError(f"request_id: {request_id!r} is already in use")
            replica = self._pick_live(model)
            if replica is not None:
                stream.replica = replica
                self._streams[request_id] = stream
                self.restarts.begin(request_id)
        if replica is None:
            raise Unavailable(f"model {model!r} has no live replica: {self._dead_summary()}; retry later")
        first = self.placement.models[model].replicas[replica][0]
        self.actors[first].add_request.remote(
            msgpack.packb([model, request_id, prompt, params.to_dict()], use_bin_type=True))
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                finished = out.final
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away: free the request everywhere
                self._abort_now(request_id, notify=False)

    async def abort(self, request_id: str, error: str | None = None) -> None:
        self._abort_now(request_id, notify=True, error=error)

    def health(self) -> dict:
        with self._lock:
            engines = {str(e): s for e, s in self.engine_state.items()}
            errors = {str(e): msg for e, msg in self.engine_error.items() if self.engine_state[e] != ALIVE}
        models = {}
        for m, mp in self.placement.models.items():
            live = [j for j in range(len(mp.replicas)) if self._replica_alive(m, j)]
            models[m] = {"replicas": len(mp.replicas), "live_replicas": len(live)}
        out = {"ok": all(s == ALIVE for s in engines.values()), "backend": "ray",
               "engines": engines, "models": models}
        if errors:
            out["errors"] = errors
        return out

    def metrics(self) -> BackendMetrics:
        with self._lock:
            live = [s.model for s in self._streams.values() if not s.held]
            held = held_by_model(self._streams.values())  # waiting for a restart
            status = dict(self._status)
            preemptions = dict(self.restarts.preemptions)
        queued = {m: 0 for m in self.placement.models}  # waiting in the engines
        usage = {}
        for e, st in status.items():
            if "kv_usage" in st:
                usage[e] = float(st["kv_usage"])
            for m, n in st.get("waiting", {}).items():
                queued[m] = queued.get(m, 0) + n
        running = {m: max(0, live.count(m) - n) for m, n in queued.items()}
        waiting = {m: n + held.get(m, 0) for m, n in queued.items()}
        return BackendMetrics(running=running, waiting=waiting, kv_cache_usage=usage, preemptions=preemptions)

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ dispatch and streams
    def _replica_alive(self, model: str, replica: int) -> bool:
        return all(self.engine_state[e] == ALIVE for e in self.placement.models[model].replicas[replica])

    def _pick_live(self, model: str) -> int | None:
        """Least outstanding among live replicas (caller holds the lock): dead picks are
        returned to the dispatcher and the next least-outstanding is tried."""
        tried = []
        chosen = None
        for _ in range(len(self.placement.models[model].replicas)):
            j = self.dispatcher.pick(model)
            if self._replica_alive(model, j):
                chosen = j
                break
            tried.append(j)
        for j in tried:
            self.dispatcher.done(model, j)
        return chosen

    def _dead_summary(self) -> str:
        dead = [f"engine {e} {s}" + (f" ({self.engine_error[e]})" if e in self.engine_error else "")
                for e, s in self.engine_state.items() if s != ALIVE]
        return "; ".join(dead) or "no engine is down"

    def _end(self, rid: str) -> _Stream | None:
        """Forget a stream and release its dispatch slot (caller holds the lock)."""
        s = self._streams.pop(rid, None)
        if s is not None:
            self.dispatcher.done(s.model, s.replica)
            self.restarts.end(s)
        return s

    def _abort_now(self, rid: str, notify: bool, error: str | None = None) -> None:
        with self._lock:
            s = self._end(rid)
        if s is None:
            return
        if not s.held:
            self._free_on_replica(s.model, s.replica, [s.engine_rid])
        if notify:
            out = Output(error=error) if error else Output(finish_reason="abort")
            s.loop.call_soon_threadsafe(s.queue.put_nowait, out)
        self._release((s.model, s.replica), ended=not s.held)

    def _preempt(self, rid: str, error: str) -> None:
        """Stop a request to free KV (a stall): it restarts by recompute (paraflex/serving/recompute.py),
        or ends with `error` after MAX_RECOMPUTES restarts."""
        with self._lock:
            s = self._streams.get(rid)
            if s is None:
                return
            held = self.restarts.stop(s)
            if held:  # freed under the lock: a restart (which takes it) cannot rename it meanwhile
                self._free_on_replica(s.model, s.replica, [s.engine_rid])
                tokens = s.tokens
        if not held:
            self._abort_now(rid, notify=True, error=error)
            return
        self.progress(f"paraflex: request {rid} stopped to free KV; it restarts by recompute after {tokens} token(s)")
        self._release((s.model, s.replica), ended=False)

    def _release(self, key: tuple[str, int], ended: bool) -> None:
        """Restart the held request of replica `key` that `to_release` names. Submitted under the
        lock, so an abort of it (which takes the lock first) reaches the engine after it."""
        with self._lock:
            got = self.restarts.release(self._streams, key, ended) if self._replica_alive(*key) else None
            if got is None:
                return
            rid, prompt, params = got
            s = self._streams[rid]
            self.actors[self.placement.models[s.model].replicas[s.replica][0]].add_request.remote(
                msgpack.packb([s.model, s.engine_rid, prompt, params.to_dict()], use_bin_type=True))

    def _free_on_replica(self, model: str, replica: int, rids: list[str], skip: int | None = None) -> None:
        payload = msgpack.packb([model, rids], use_bin_type=True)
        for e in self.placement.models[model].replicas[replica]:
            if e != skip and self.engine_state[e] == ALIVE:
                self.actors[e].abort.remote(payload)

    def _poll_outputs(self) -> None:
        while not self._closed.is_set():
            try:
                payloads = ray.get(self.router.take.remote(MONITOR_EVERY_S))
            except Exception as exc:  # noqa: BLE001 - the router died: nothing can stream
                if self._closed.is_set():
                    return
                self._fail_all(f"output router failed: {type(exc).__name__}: {exc}")
                return
            for payload in payloads:
                for engine_rid, tokens, finish, error in unpack_records(payload):
                    out = Output(list(tokens), finish, error)
                    with self._lock:
                        rid = self.restarts.client_of.get(engine_rid)  # None: ended, or a run stopped for a restart
                        s = None if rid is None else self._end(rid) if out.final else self._streams.get(rid)
                        if s is not None:
                            s.output.extend(out.token_ids)
                    if s is not None:
                        s.loop.call_soon_threadsafe(s.queue.put_nowait, out)
                        if out.final:
                            self._release((s.model, s.replica), ended=True)

    def _fail_all(self, error: str) -> None:
        with self._lock:
            streams = [self._end(rid) for rid in list(self._streams)]
        for s in streams:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, Output(error=error))

    # ------------------------------------------------------------------ faults
    def _monitor(self) -> None:
        pending: dict[int, object] = {}
        while not self._closed.wait(MONITOR_EVERY_S):
            for e, actor in self.actors.items():
                info = _actor_info(actor)
                if info is not None and (info[0] != "ALIVE" or info[1] > self._restarts.get(e, 0)):
                    # The GCS knows at once; a status call to a restarting actor would only
                    # return once the new incarnation is up.
                    self._engine_down(e, f"engine {e} died ({info[0].lower()})")
                if e not in pending:
                    pending[e] = actor.status.remote()
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=MONITOR_EVERY_S)
            ready = set(ready)
            fresh: set[int] = set()
            for e, ref in list(pending.items()):
                if ref not in ready:
                    continue
                del pending[e]
                try:
                    st = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayActorError and friends: it died
                    self._engine_down(e, f"engine {e} died ({type(exc).__name__})")
                    continue
                self._engine_seen(e, st)
                fresh.add(e)
            self._check_stall(time.monotonic(), fresh)

    def _check_stall(self, now: float, fresh: set[int]) -> None:
        """Hand the KV-stall watch (paraflex/serving/kv_stall.py) the batch counts of the engines that
        answered this round and the live streams per replica; end the requests it names."""
        with self._lock:
            runs = {e: st.get("runs") if e in fresh else None for e, st in self._status.items()
                    if self.engine_state[e] == ALIVE}
            replicas = live_by_replica(self.placement, self._streams)
        for rid, error in self.stall_watch.check(now, runs, replicas):
            self._preempt(rid, error)

    def _engine_seen(self, e: int, st: dict) -> None:
        with self._lock:
            self._status[e] = st
        restarted = st["incarnation"] != self._incarnation.get(e)
        if st["state"] == FAILED:
            self._engine_down(e, f"engine {e} failed: {st.get('error')}")
        elif restarted:
            self._engine_down(e, f"engine {e} restarted")
            if st["state"] == READY:
                self._rejoin(e, st)

    def _engine_down(self, e: int, reason: str) -> None:
        with self._lock:
            if self.engine_state[e] != ALIVE:
                return
            self.engine_state[e] = DEAD
            self.engine_error[e] = reason
            hit = [(rid, s) for rid, s in self._streams.items()
                   if e in self.placement.models[s.model].replicas[s.replica]]
            for rid, _ in hit:
                self._end(rid)
        self.progress(f"paraflex: {reason}; failing {len(hit)} request(s) on its replicas")
        by_replica: dict[tuple[str, int], list[str]] = {}
        for rid, s in hit:
            if not s.held:
                by_replica.setdefault((s.model, s.replica), []).append(s.engine_rid)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, Output(error=reason))
        for (model, replica), rids in by_replica.items():
            self._free_on_replica(model, replica, rids, skip=e)

    def _rejoin(self, e: int, st: dict) -> None:
        """A restarted engine has reloaded: rebuild its replicas' process groups, then let them
        back into dispatch."""
        bumped = []
        for key, g in self.groups.items():
            if e in g.engines:
                self.groups[key] = GroupSpec(g.model, g.replica, g.engines, g.generation + 1)
                bumped.append(self.groups[key])
        members = sorted({m for g in bumped for m in g.engines} | {e})
        wire = [g.to_wire() for g in bumped]
        try:
            ray.get([self.actors[m].connect.remote(self.actors, wire, *self._store_addr) for m in members],
                    timeout=60)
        except Exception as exc:  # noqa: BLE001 - stays down; the next status poll retries
            self.progress(f"paraflex: engine {e} restarted but could not rejoin: {exc}")
            return
        info = _actor_info(self.actors[e])
        with self._lock:
            self._incarnation[e] = st["incarnation"]
            if info is not None:
                self._restarts[e] = info[1]
            self.engine_state[e] = ALIVE
            self.engine_error.pop(e, None)
        self.progress(f"paraflex: engine {e} rejoined (pid {st['pid']})")

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop every actor, the threads, and the Ray instance this backend started."""
        if self._closed.is_set():
            return
        self._closed.set()
        for t in self._threads:
            if t.is_alive():
                t.join(5.0)
        self._fail_all("server shutting down")
        refs = [a.stop.remote() for a in self.actors.values()]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        finally:
            for a in list(self.actors.values()) + [self.router]:
                ray.kill(a, no_restart=True)
            self._store = None
            if self._ray_dir is not None:
                ray.shutdown()
                shutil.rmtree(self._ray_dir, ignore_errors=True)


def _actor_info(actor) -> tuple[str, int] | None:
    """(state, restart count) of an actor from Ray's GCS, or None if Ray cannot say.

    Uses `ray._private.state`: the public `ray.util.state` needs the dashboard, which the
    embedded Ray instance does not start."""
    try:
        from ray._private import state

        info = state.actors(actor_id=actor._actor_id.hex())
        return str(info["State"]), int(info.get("NumRestarts", 0))
    except Exception:  # noqa: BLE001 - an older/newer Ray: fall back on status() calls
        return None
