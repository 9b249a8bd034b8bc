"""Ray transport: the two-phase hop between engine actors (paper §6.3 and §7).

Data flow: an engine loop inside an engine actor (paraflex.engine.ray_engine) calls
`RayTransport.send(env)`; the envelope goes to the model's dedicated send thread, which
  phase 1: packs `env.meta` plus the tensor descriptors (name, dtype, shape) and a per-model
           sequence number into msgpack bytes and fires `peer.deliver.remote(payload)`
           (a Ray actor call; user data is never pickled);
  phase 2: sends the hidden/residual tensors over torch.distributed point-to-point on the
           process group of the model replica (gloo on CPU, NCCL on CUDA).
On CPU, a batch for the next stage of the replica goes into receives the successor posted
ahead of time (pre-posted slots, paraflex.engine.transport_slots): the tensors are sent before
the phase-1 call is submitted and travel while it does. Other transfers (tensors larger than
a slot, hops that are not stage-to-next-stage, CUDA) take the rendezvous way: the receiving
actor's `deliver` hands the payload to `RayTransport.deliver`, which posts the matching `recv`s
and queues the wait on that model's receive thread. Either way the complete envelope is parked
in the arrival buffer keyed by (model, batch id, stage) until the engine loop drains it with
`recv_ready()`. Engines run work in a different order than their predecessors, so nothing here
assumes arrival order equals execution order.

Process groups: one per model replica, over the engines the replica spans (paper §6.3:
"unique process groups among the workers where the model is deployed"). Each group is its own
`ProcessGroupGloo`/`ProcessGroupNCCL` built from a shared TCPStore under a prefix naming the
model, replica and generation, not a `new_group` of one global world: a global world cannot
re-admit a restarted rank, whereas a per-replica group is rebuilt alone (next generation) when
one of its engines comes back, and one model's traffic never queues behind another model's on
a shared communicator. Per-hop pairs would need one group per stage boundary for the same
isolation; a replica group already gives each hop its own gloo pair (full mesh) or NCCL p2p
communicator (created lazily per rank pair).

GPU: each model has a CUDA stream pair (send, receive); the send stream waits on an event
recorded on the producer's stream at `send()` time, and a receive is reported only once its
stream has finished. CPU: slot receives wait on one thread per hop (transport_slots),
rendezvous receives are posted as soon as the phase-1 call lands; the send/receive threads
block in gloo's `wait()`, off the engine thread.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist

from paraflex.engine.transport import Envelope, Transport
from paraflex.engine.transport_slots import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_WINDOW,
    PACK_BYTES,
    SlotInbox,
    SlotTable,
    pack,
    pack_offsets,
    slot_tag,
    slot_views,
)

WIRE_VERSION = 2
# Rendezvous gloo/NCCL tags: each tensor of a transfer gets seq * MAX_TENSORS + index (gloo
# matches on it; NCCL ignores tags and matches in order, which the per-model FIFO threads
# preserve). Slot transfers use the tags above TAG_SPACE (transport_slots.slot_tag).
MAX_TENSORS = 16
TAG_SPACE = 2**30

_DTYPES = {
    str(dt): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
               torch.int32, torch.int8, torch.uint8, torch.bool)
}

ErrorCallback = Callable[[str, int, BaseException], None]


@dataclass(frozen=True)
class GroupSpec:
    """The process group of one model replica: its engines in stage order.

    `generation` grows each time the group is rebuilt (an engine of the replica restarted);
    every member must build the same generation at the same time.
    """

    model: str
    replica: int
    engines: tuple[int, ...]
    generation: int = 0

    def __post_init__(self) -> None:
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(
                f"GroupSpec {self.model}/{self.replica}: engine listed twice in {self.engines}; "
                "a replica may place at most one stage on an engine")

    @property
    def store_prefix(self) -> str:
        return f"paraflex/pg/{self.model}/{self.replica}/gen{self.generation}"

    def to_wire(self) -> list:
        return [self.model, self.replica, list(self.engines), self.generation]

    @classmethod
    def from_wire(cls, w: list) -> "GroupSpec":
        return cls(w[0], int(w[1]), tuple(int(e) for e in w[2]), int(w[3]))


def start_store(host: str) -> tuple[dist.TCPStore, int]:
    """The rendezvous store every process group is built from (held by the controller)."""
    store = dist.TCPStore(host, 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    return store, store.port


# ----------------------------------------------------------------------------- phase 1 wire

def encode_phase1(env: Envelope, seq: int, replica: int | None,
                  slots: tuple[int, int, bool] | None = None) -> bytes:
    """msgpack bytes of one envelope's metadata and tensor descriptors (no tensor data).

    `slots` = (group generation, first slot index, packed) when the tensors went into the
    receiver's pre-posted slots: all in one slot if packed, else one slot per tensor in order;
    None for the rendezvous way."""
    specs = None
    if env.tensors:
        if len(env.tensors) > MAX_TENSORS:
            raise ValueError(f"Envelope.tensors: {len(env.tensors)} tensors; at most {MAX_TENSORS}")
        specs = [[name, str(t.dtype), list(t.shape)] for name, t in env.tensors.items()]
    return msgpack.packb(
        {"v": WIRE_VERSION, "src": env.src, "dst": env.dst, "model": env.model, "kind": env.kind,
         "meta": env.meta, "seq": seq, "replica": replica, "tensors": specs,
         "slots": list(slots) if slots is not None else None},
        use_bin_type=True)


def decode_phase1(payload: bytes) -> tuple[Envelope, list | None, int, int | None, tuple | None]:
    """(envelope without tensors, tensor descriptors, seq, replica, slots) from
    `encode_phase1` bytes."""
    d = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if d.get("v") != WIRE_VERSION:
        raise ValueError(f"phase-1 payload version {d.get('v')!r}; this engine speaks {WIRE_VERSION} "
                         "(all engines must run the same paraflex version)")
    env = Envelope(src=d["src"], dst=d["dst"], model=d["model"], kind=d["kind"], meta=d["meta"])
    slots = tuple(d["slots"]) if d["slots"] is not None else None
    return env, d["tensors"], d["seq"], d["replica"], slots


def arrival_key(env: Envelope, seq: int) -> tuple:
    """Key of the arrival buffer: (model, batch id, stage) for batches, else unique per message."""
    meta = env.meta if isinstance(env.meta, dict) else {}
    if env.kind == "batch" and "batch" in meta:  # engine-core BatchMessage.to_dict()
        return (env.model, meta["batch"], meta.get("stage"))
    return (env.model, env.kind, env.src, seq)


# ----------------------------------------------------------------------------- groups

class _Group:
    """One built process group plus this engine's rank in it."""

    def __init__(self, spec: GroupSpec, engine_id: int, store: dist.Store, backend: str,
                 timeout_s: float) -> None:
        self.spec = spec
        self.rank_of = {e: i for i, e in enumerate(spec.engines)}
        self.next_slot = 0  # slot transfers sent to the successor (the model's send thread)
        self.inbox: SlotInbox | None = None  # slot receives from the predecessor
        prefixed = dist.PrefixStore(spec.store_prefix, store)
        rank, size = self.rank_of[engine_id], len(spec.engines)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def send(self, tensors: list[torch.Tensor], dst: int, seq: int) -> list:
        base = (seq % (TAG_SPACE // MAX_TENSORS)) * MAX_TENSORS
        return [self.pg.send([t], self.rank_of[dst], base + i) for i, t in enumerate(tensors)]

    def recv(self, tensors: list[torch.Tensor], src: int, seq: int) -> list:
        base = (seq % (TAG_SPACE // MAX_TENSORS)) * MAX_TENSORS
        return [self.pg.recv([t], self.rank_of[src], base + i) for i, t in enumerate(tensors)]

    def neighbour(self, engine: int, step: int) -> int | None:
        """The engine `step` stages after (+1) or before (-1) `engine` in the replica."""
        i = self.rank_of[engine] + step
        return self.spec.engines[i] if 0 <= i < len(self.spec.engines) else None

    def send_slots(self, tensors: list[torch.Tensor], dst: int, first: int) -> list:
        """Send each tensor into the successor's pre-posted slot first, first+1, ..."""
        return [self.pg.send([t], self.rank_of[dst], slot_tag(first + i))
                for i, t in enumerate(tensors)]


# ----------------------------------------------------------------------------- per-model lanes

@dataclass
class _Outgoing:
    env: Envelope
    seq: int
    replica: int | None
    ready_event: Any = None  # torch.cuda.Event on the producer's stream (GPU)


@dataclass
class _Incoming:
    env: Envelope
    specs: list | None
    seq: int
    replica: int | None
    bufs: list | None = None  # CPU: receive buffers (rendezvous: posted; slots: as they land)
    works: list | None = None  # CPU rendezvous: the posted gloo works
    missing: int = 0  # slots: buffers not landed yet
    packed: bool = False  # slots: all tensors in one slot (transport_slots.pack)
    done: bool = False  # tensors complete (or failed): may leave the lane's arrival order
    error: BaseException | None = None


class _ModelLane:
    """The dedicated send thread and receive thread (and CUDA stream pair) of one model.

    `order` holds this model's phase-1 arrivals that are not released yet, in arrival order;
    an arrival is released into the arrival buffer once it and all before it are complete, so
    a metadata-only message never overtakes an earlier batch of the model (guarded by the
    owner's lock)."""

    def __init__(self, owner: "RayTransport", model: str) -> None:
        self.owner = owner
        self.model = model
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.recv_q: queue.SimpleQueue = queue.SimpleQueue()
        self.order: deque[_Incoming] = deque()
        self.next_seq = 0
        self.streams = None
        if owner.device.type == "cuda":
            self.streams = (torch.cuda.Stream(owner.device), torch.cuda.Stream(owner.device))
        self.threads = [
            threading.Thread(target=self._send_loop, name=f"pf-send-{model}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"pf-recv-{model}", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def stop(self, timeout: float) -> None:
        self.send_q.put(None)
        self.recv_q.put(None)
        for t in self.threads:
            t.join(timeout)

    # -- send side ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            job = self.send_q.get()
            if job is None:
                return
            try:
                self._send_one(job)
            except BaseException as exc:  # noqa: BLE001 - reported, the lane keeps serving
                self.owner._report(self.model, job.env.dst, exc)

    def _send_one(self, job: _Outgoing) -> None:
        env, owner = job.env, self.owner
        if not env.tensors:
            owner._phase1(env.dst, encode_phase1(env, job.seq, job.replica))
            return
        group = owner._group_for(env.model, env.src, env.dst, job.replica)
        tensors = list(env.tensors.values())
        if self.streams is None and owner._slots_fit(group, env.src, env.dst, tensors):
            # Into pre-posted slots gloo writes the bytes inside `send` (about 1.7 ms for
            # 2.4 MB here), so phase 1 is submitted first and is on its way meanwhile
            # (measured: prefill hop 4.1-4.6 ms vs 4.8-5.1 ms with the data sent first).
            packed = (len(tensors) > 1 and pack_offsets([t.nbytes for t in tensors])[1]
                      <= min(PACK_BYTES, owner.slot_bytes))
            if packed:
                tensors = [pack(tensors)]
            first = group.next_slot
            group.next_slot += len(tensors)
            owner._phase1(env.dst, encode_phase1(env, job.seq, job.replica,
                                                 (group.spec.generation, first, packed)))
            for work in group.send_slots(tensors, env.dst, first):
                work.wait()
            return
        # The rendezvous way: the sends are posted (queued, the receiver has not asked yet)
        # before the phase-1 call is submitted (about a millisecond in Ray), so the receiver
        # finds them in flight when it posts the matching receives on the phase-1 arrival.
        payload = encode_phase1(env, job.seq, job.replica)
        if self.streams is None:
            works = group.send(tensors, env.dst, job.seq)
            owner._phase1(env.dst, payload)
            for work in works:
                work.wait()
            return
        send_stream = self.streams[0]
        with torch.cuda.stream(send_stream):
            send_stream.wait_event(job.ready_event)
            works = group.send(tensors, env.dst, job.seq)
            owner._phase1(env.dst, payload)
            for work in works:
                work.wait()
        send_stream.synchronize()  # keep `tensors` alive until NCCL has read them

    # -- receive side (rendezvous) -----------------------------------------------------------
    def post_cpu_receives(self, job: _Incoming) -> None:
        """Post the gloo receives at once (on the phase-1 call); the lane thread waits."""
        owner = self.owner
        group = owner._group_for(job.env.model, job.env.src, job.env.dst, job.replica)
        job.bufs = [torch.empty(s[2], dtype=_DTYPES[s[1]]) for s in job.specs]
        job.works = group.recv(job.bufs, job.env.src, job.seq)

    def _recv_loop(self) -> None:
        while True:
            job = self.recv_q.get()
            if job is None:
                return
            try:
                job.env.tensors = self._recv_tensors(job)
            except BaseException as exc:  # noqa: BLE001 - reported, the lane keeps serving
                job.error = exc
            self.owner._complete(self, job)

    def _recv_tensors(self, job: _Incoming) -> dict[str, torch.Tensor]:
        names = [s[0] for s in job.specs]
        if self.streams is None:
            if job.error is not None:
                raise job.error
            for work in job.works:
                work.wait()
            return dict(zip(names, job.bufs))
        owner = self.owner
        group = owner._group_for(job.env.model, job.env.src, job.env.dst, job.replica)
        recv_stream = self.streams[1]
        with torch.cuda.stream(recv_stream):
            bufs = [torch.empty(s[2], dtype=_DTYPES[s[1]], device=owner.device) for s in job.specs]
            for work in group.recv(bufs, job.env.src, job.seq):
                work.wait()
        recv_stream.synchronize()  # "fully arrived": the consumer may use them on any stream
        return dict(zip(names, bufs))


# ----------------------------------------------------------------------------- the transport

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
    (paraflex.engine.transport_slots); 0 sends everything the rendezvous way.
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
        self._groups: dict[tuple[str, int], _Group] = {}
        self._lanes: dict[str, _ModelLane] = {}
        self._ready: OrderedDict[tuple, Envelope] = OrderedDict()
        self._slots = SlotTable()
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
            current = self._groups.get((spec.model, spec.replica))
            if current is not None and current.spec.generation >= spec.generation:
                continue
            group = _Group(spec, self.engine_id, self._store, self.backend, self.timeout_s)
            self._groups[(spec.model, spec.replica)] = group
            if current is not None:
                self._retire_inbox(current, "its process group was rebuilt")
            self._open_inbox(group)

    def group_generations(self) -> dict[str, int]:
        return {f"{m}/{r}": g.spec.generation for (m, r), g in self._groups.items()}

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
            self._group_for(env.model, env.src, env.dst, replica)  # fail fast, before phase 1
        lane = self._lane(env.model)
        with self._lock:
            seq = lane.next_seq
            lane.next_seq += 1
        ready_event = None
        if env.tensors and lane.streams is not None:
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(self.device))
        lane.send_q.put(_Outgoing(env, seq, replica, ready_event))

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
        for group in list(self._groups.values()):
            self._retire_inbox(group, "the transport closed")
        self._lanes.clear()
        self._groups.clear()

    # -- phase-1 arrival (called by the actor's `deliver` method) ----------------------------
    def deliver(self, payload: bytes) -> None:
        env, specs, seq, replica, slots = decode_phase1(payload)
        if self._closed:
            return
        lane = self._lane(env.model)
        job = _Incoming(env, specs, seq, replica)
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
                    job.done = self._slots.claim((env.model, replica, slots[0], env.src),
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

    # -- internals used by the lanes and slot inboxes ----------------------------------------
    def _lane(self, model: str) -> _ModelLane:
        with self._lock:
            lane = self._lanes.get(model)
            if lane is None:
                lane = self._lanes[model] = _ModelLane(self, model)
            return lane

    def _replica_of(self, env: Envelope) -> int | None:
        meta = env.meta if isinstance(env.meta, dict) else {}
        if "replica" in meta:
            return int(meta["replica"])
        for (model, replica), group in self._groups.items():
            if model == env.model and env.src in group.rank_of and env.dst in group.rank_of:
                return replica
        return None

    def _group_for(self, model: str, src: int, dst: int, replica: int | None) -> _Group:
        group = self._groups.get((model, replica)) if replica is not None else None
        if group is None or src not in group.rank_of or dst not in group.rank_of:
            raise RuntimeError(
                f"no process group of model {model!r} joins engines {src} and {dst}; "
                "connect() must be given the GroupSpec of every replica this engine hosts")
        return group

    def _slots_fit(self, group: _Group, src: int, dst: int, tensors: list[torch.Tensor]) -> bool:
        """Whether this transfer goes into the receiver's pre-posted slots: the receiver is the
        next stage of the replica (the only hop it posts slots for) and each tensor fits one."""
        return (self.slot_bytes > 0 and group.neighbour(src, +1) == dst
                and all(0 < t.nbytes <= self.slot_bytes for t in tensors))

    def _open_inbox(self, group: _Group) -> None:
        """Post slot receives for the previous stage of `group`'s replica (if any)."""
        src = group.neighbour(self.engine_id, -1)
        if self.slot_bytes <= 0 or src is None:
            return
        spec = group.spec
        hop = (spec.model, spec.replica, spec.generation, src)
        with self._lock:
            self._slots.open(hop)
        group.inbox = SlotInbox(
            group.pg, group.rank_of[src], self.slot_bytes, self.slot_window,
            on_landed=lambda k, buf: self._slot_landed(hop, k, buf),
            on_failed=lambda exc: self._slots_failed(hop, exc, report=True),
            name=f"pf-slots-{spec.model}-{spec.replica}")

    def _retire_inbox(self, group: _Group, why: str) -> None:
        if group.inbox is None:
            return
        group.inbox.retire()
        src = group.neighbour(self.engine_id, -1)
        spec = group.spec
        self._slots_failed((spec.model, spec.replica, spec.generation, src),
                           RuntimeError(f"slot receives closed: {why}"), report=False)

    def _slot_landed(self, hop: tuple, k: int, buf: torch.Tensor) -> None:
        with self._cv:
            job = self._slots.land(hop, k, buf)
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
            jobs = self._slots.close(hop)
            lanes = set()
            for job in jobs:
                job.error, job.done = exc, True
                lanes.add(job.env.model)
            failed = [job for m in lanes for job in self._release(self._lanes[m])]
        self._report_failed(failed)
        if report:
            self._report(hop[0], hop[3], exc)

    def _fill_from_slots(self, job: _Incoming) -> None:
        specs = [(name, _DTYPES[dtype], shape) for name, dtype, shape in job.specs]
        try:
            job.env.tensors = slot_views(specs, job.bufs, job.packed)
        except ValueError as exc:
            job.error = exc

    def _complete(self, lane: _ModelLane, job: _Incoming) -> None:
        """A rendezvous receive finished (or failed) on the lane thread."""
        with self._cv:
            job.done = True
            failed = self._release(lane)
        self._report_failed(failed)

    def _release(self, lane: _ModelLane) -> list[_Incoming]:
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

    def _report_failed(self, jobs: list[_Incoming]) -> None:
        for job in jobs:
            self._report(job.env.model, job.env.src, job.error)

    def _phase1(self, dst: int, payload: bytes) -> None:
        peer = self._peers.get(dst)
        if peer is None:
            raise RuntimeError(f"engine {self.engine_id} has no handle for engine {dst}; "
                               "pass every engine to connect(peers=...)")
        # Fire and forget: a dead peer is detected by the controller's health monitor
        # (paraflex.ray_backend), which fails that replica's requests.
        peer.deliver.remote(payload)

    def _report(self, model: str, peer: int, exc: BaseException) -> None:
        msg = f"engine {self.engine_id}: transfer of {model!r} with engine {peer} failed: {exc}"
        self.errors.append(msg)
        if self.on_error is not None:
            self.on_error(model, peer, exc)
