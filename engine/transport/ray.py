"""Ray transport: the two-phase hop between engine actors (paper §6.3 and §7).

Data flow: an engine loop inside an engine actor (paraflex.engine.ray_engine) calls
`RayTransport.send(env)`; the envelope goes to the model's dedicated send thread
(paraflex.engine.transport.ray_lanes), which
  phase 1: packs `env.meta` plus the tensor descriptors (name, dtype, shape) and a per-model
           sequence number into msgpack bytes (paraflex.engine.transport.ray_wire) and fires
           `peer.deliver.remote(payload)` (a Ray actor call; user data is never pickled);
  phase 2: sends the hidden/residual tensors over torch.distributed point-to-point on the
           process group of the model replica (gloo on CPU, NCCL on CUDA;
           paraflex.engine.transport.ray_groups).
On CPU, a batch for the next stage of the replica goes into receives the successor posted
ahead of time (pre-posted slots, paraflex.engine.transport.ray_slots): the tensors are sent before
the phase-1 call is submitted and travel while it does. Other transfers (tensors larger than
a slot, hops that are not stage-to-next-stage, CUDA) take the rendezvous way: the receiving
actor's `deliver` hands the payload to `RayTransport.deliver`, which posts the matching `recv`s
and queues the wait on that model's receive thread. Either way the complete envelope is parked
in the arrival buffer keyed by (model, batch id, stage) until the engine loop drains it with
`recv_ready()`. Engines run work in a different order than their predecessors, so nothing here
assumes arrival order equals execution order.

This module is the endpoint: set-up (`connect`), the Transport API, phase-1 arrival, and the
pairing of arrivals with their tensors (slots or lane receives) in per-model arrival order.
`GroupSpec` and `start_store` are re-exported: they are part of its set-up API.

GPU: each model has a CUDA stream pair (send, receive); the send stream waits on an event
recorded on the producer's stream at `send()` time, and a receive is reported only once its
stream has finished. CPU: slot receives wait on one thread per hop (ray_slots),
rendezvous receives are posted as soon as the phase-1 call lands; the send/receive threads
block in gloo's `wait()`, off the engine thread.
"""

from __future__ import annotations

import datetime
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist

from paraflex.engine.transport.base import Envelope, Transport
from paraflex.engine.transport.ray_groups import GroupSpec, ReplicaGroup, ReplicaGroups, start_store
from paraflex.engine.transport.ray_lanes import (
    IncomingTransfer,
    LaneLinks,
    ModelLane,
    OutgoingTransfer,
)
from paraflex.engine.transport.ray_slots import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_WINDOW,
    SlotInbox,
    SlotTable,
    slot_views,
)
from paraflex.engine.transport.ray_wire import WIRE_DTYPES, arrival_key, decode_phase1

__all__ = ["ErrorCallback", "GroupSpec", "RayTransport", "start_store"]

ErrorCallback = Callable[[str, int, BaseException], None]


class RayTransport(Transport):
    """One engine's endpoint of the two-phase transport.

    Lifecycle: construct in the engine actor; `connect(peers, groups, store_host, store_port)`
    on every engine at once (group construction is a rendezvous); then `send`/`recv_ready`
    from the engine loop and `deliver` from the actor's `deliver` method; `close()` at the end.
    `connect` may be called again with a higher group generation after an engine restarts.
    Failures on a lane (peer gone, timeout) go to `on_error(model, peer, exc)`; the lane keeps
    serving other requests.

    `slot_bytes` (CPU only; every engine must use the same value): tensors up to this size
    sent to the next stage of their replica go into pre-posted receive slots
    (paraflex.engine.transport.ray_slots); 0 sends everything the rendezvous way.
    """

    def __init__(self, engine_id: int, device: str | torch.device = "cpu",
                 on_error: ErrorCallback | None = None, timeout_s: float = 30.0,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, slot_window: int = DEFAULT_WINDOW) -> None:
        self.engine_id = engine_id
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes if self.backend == "gloo" else 0
        self.slot_window = slot_window
        self._peers: dict[int, Any] = {}
        self.groups = ReplicaGroups()
        self.slot_table = SlotTable()  # guarded by the lock
        self._lanes: dict[str, ModelLane] = {}
        self._lane_links = LaneLinks(self.device, self.slot_bytes, self.groups,
                                     send_phase1=self._phase1, on_received=self._complete,
                                     on_failed=self._report)
        self._ready: OrderedDict[tuple, Envelope] = OrderedDict()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._kicked = False
        self._store = None
        self.errors: list[str] = []

    # -- set-up ------------------------------------------------------------------------------
    def connect(self, peers: dict[int, Any], groups: list[GroupSpec], store_host: str,
                store_port: int) -> None:
        """Record peer actor handles and build this engine's process groups (blocks until every
        member of each group has joined; call on all engines concurrently)."""
        if self._store is None:
            self._store = dist.TCPStore(store_host, store_port, None, False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        self._peers.update({int(k): v for k, v in peers.items()})
        for spec in groups:
            if self.engine_id not in spec.engines or len(spec.engines) < 2:
                continue
            current = self.groups.get(spec.model, spec.replica)
            if current is not None and current.spec.generation >= spec.generation:
                continue
            group = ReplicaGroup(spec, self.engine_id, self._store, self.backend, self.timeout_s, store_host)
            self.groups.install(group)
            if current is not None:
                self._retire_inbox(current, "its process group was rebuilt")
            self._open_inbox(group)

    def leave(self, model: str, engines: tuple[int, ...]) -> None:
        """Drop the process group of `model`'s replica on `engines` (removed live): later hops of
        the model find only the groups of its replicas that stay."""
        group = self.groups.remove_on(model, engines)
        if group is not None:
            self._retire_inbox(group, "its replica was removed")

    def group_generations(self) -> dict[str, int]:
        return self.groups.generations()

    # -- Transport API -----------------------------------------------------------------------
    def send(self, env: Envelope) -> None:
        if self._closed:
            raise RuntimeError("RayTransport.send: transport is closed")
        if env.tensors:
            env.tensors = {k: t.detach().contiguous() for k, t in env.tensors.items()}
        if env.dst == self.engine_id:  # loopback (a one-stage model's token feedback)
            with self._cv:
                self._ready[(env.model, env.kind, env.src, id(env))] = env
                self._cv.notify_all()
            return
        replica = self._replica_of(env)
        if env.tensors:
            self.groups.for_hop(env.model, env.src, env.dst, replica)  # fail fast, before phase 1
        lane = self._lane(env.model)
        with self._lock:
            seq = lane.next_seq
            lane.next_seq += 1
        ready_event = None
        if env.tensors and lane.streams is not None:
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(self.device))
        lane.send_q.put(OutgoingTransfer(env, seq, replica, ready_event))

    def recv_ready(self) -> list[Envelope]:
        with self._lock:
            out = list(self._ready.values())
            self._ready.clear()
        return out

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` s until an envelope is ready or `notify()` is called (lets an
        idle engine loop sleep). True if an envelope is ready."""
        with self._cv:
            if not self._ready and not self._closed and not self._kicked:
                self._cv.wait(timeout)
            self._kicked = False
            return bool(self._ready)

    def notify(self) -> None:
        """Wake `wait()` (the engine has other work, e.g. a new request)."""
        with self._cv:
            self._kicked = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for lane in list(self._lanes.values()):
            lane.stop(timeout=1.0)
        for group in self.groups.all():
            self._retire_inbox(group, "the transport closed")
        self._lanes.clear()
        self.groups.clear()

    # -- phase-1 arrival (called by the actor's `deliver` method) ----------------------------
    def deliver(self, payload: bytes) -> None:
        env, specs, seq, replica, slots = decode_phase1(payload)
        if self._closed:
            return
        lane = self._lane(env.model)
        job = IncomingTransfer(env, specs, seq, replica)
        with self._cv:
            # Metadata-only messages skip the lane unless earlier arrivals of the same model
            # are still incomplete, so they never overtake an earlier batch of that model.
            if not specs and not lane.order:
                self._ready[arrival_key(env, seq)] = env
                self._cv.notify_all()
                return
            lane.order.append(job)
            if specs and slots is not None:
                job.packed = bool(slots[2])
                job.bufs = [None] * (1 if job.packed else len(specs))
                try:
                    job.done = self.slot_table.claim((env.model, replica, slots[0], env.src),
                                                     slots[1], job)
                except RuntimeError as exc:
                    job.error, job.done = exc, True
                if job.done and job.error is None:
                    self._fill_from_slots(job)
            else:
                job.done = not specs
            failed = self._release(lane) if job.done else []
        self._report_failed(failed)
        if specs and slots is None:  # rendezvous: post now, the lane thread waits
            if lane.streams is None:
                try:
                    lane.post_cpu_receives(job)
                except BaseException as exc:  # noqa: BLE001 - surfaces on the lane, in order
                    job.error = exc
            lane.recv_q.put(job)

    # -- internals (the lanes and slot inboxes reach some of them as callbacks) --------------
    def _lane(self, model: str) -> ModelLane:
        with self._lock:
            lane = self._lanes.get(model)
            if lane is None:
                lane = self._lanes[model] = ModelLane(self._lane_links, model)
            return lane

    def _replica_of(self, env: Envelope) -> int | None:
        meta = env.meta if isinstance(env.meta, dict) else {}
        if "replica" in meta:
            return int(meta["replica"])
        return self.groups.replica_joining(env.model, env.src, env.dst)

    def _open_inbox(self, group: ReplicaGroup) -> None:
        """Post slot receives for the previous stage of `group`'s replica (if any)."""
        src = group.neighbour(self.engine_id, -1)
        if self.slot_bytes <= 0 or src is None:
            return
        spec = group.spec
        hop = (spec.model, spec.replica, spec.generation, src)
        with self._lock:
            self.slot_table.open(hop)
        group.inbox = SlotInbox(
            group.pg, group.rank_of[src], self.slot_bytes, self.slot_window,
            on_landed=lambda k, buf: self._slot_landed(hop, k, buf),
            on_failed=lambda exc: self._slots_failed(hop, exc, report=True),
            name=f"pf-slots-{spec.model}-{spec.replica}")

    def _retire_inbox(self, group: ReplicaGroup, why: str) -> None:
        if group.inbox is None:
            return
        group.inbox.retire()
        src = group.neighbour(self.engine_id, -1)
        spec = group.spec
        self._slots_failed((spec.model, spec.replica, spec.generation, src),
                           RuntimeError(f"slot receives closed: {why}"), report=False)

    def _slot_landed(self, hop: tuple, k: int, buf: torch.Tensor) -> None:
        with self._cv:
            job = self.slot_table.land(hop, k, buf)
            if job is None:
                return
            self._fill_from_slots(job)
            lane = self._lanes[job.env.model]
            job.done = True
            failed = self._release(lane)
        self._report_failed(failed)

    def _slots_failed(self, hop: tuple, exc: BaseException, report: bool) -> None:
        """The slots of `hop` will never land: fail the arrivals waiting for them."""
        with self._cv:
            jobs = self.slot_table.close(hop)
            lanes = set()
            for job in jobs:
                job.error, job.done = exc, True
                lanes.add(job.env.model)
            failed = [job for m in lanes for job in self._release(self._lanes[m])]
        self._report_failed(failed)
        if report:
            self._report(hop[0], hop[3], exc)

    def _fill_from_slots(self, job: IncomingTransfer) -> None:
        specs = [(name, WIRE_DTYPES[dtype], shape) for name, dtype, shape in job.specs]
        try:
            job.env.tensors = slot_views(specs, job.bufs, job.packed)
        except ValueError as exc:
            job.error = exc

    def _complete(self, lane: ModelLane, job: IncomingTransfer) -> None:
        """A rendezvous receive finished (or failed) on the lane thread."""
        with self._cv:
            job.done = True
            failed = self._release(lane)
        self._report_failed(failed)

    def _release(self, lane: ModelLane) -> list[IncomingTransfer]:
        """Move the lane's completed arrivals, in arrival order, into the arrival buffer;
        returns those that failed (caller holds the lock, reports them after)."""
        failed = []
        while lane.order and lane.order[0].done:
            job = lane.order.popleft()
            if job.error is not None:
                failed.append(job)
            else:
                self._ready[arrival_key(job.env, job.seq)] = job.env
        self._cv.notify_all()
        return failed

    def _report_failed(self, jobs: list[IncomingTransfer]) -> None:
        for job in jobs:
            self._report(job.env.model, job.env.src, job.error)

    def _phase1(self, dst: int, payload: bytes) -> None:
        peer = self._peers.get(dst)
        if peer is None:
            raise RuntimeError(f"engine {self.engine_id} has no handle for engine {dst}; "
                               "pass every engine to connect(peers=...)")
        # Fire and forget: a dead peer is detected by the controller's health monitor
        # (paraflex.serving.ray_backend), which fails that replica's requests.
        peer.deliver.remote(payload)

    def _report(self, model: str, peer: int, exc: BaseException) -> None:
        msg = f"engine {self.engine_id}: transfer of {model!r} with engine {peer} failed: {exc}"
        self.errors.append(msg)
        if self.on_error is not None:
            self.on_error(model, peer, exc)
