"""Ray transport: the two-phase hop between engine actors (paper §6.3 and §7).

Data flow: an engine loop inside an engine actor (paraflex.engine.ray_engine) calls
`RayTransport.send(env)`; the envelope goes to the model's dedicated send thread, which
  phase 1: packs `env.meta` plus the tensor descriptors (name, dtype, shape) and a per-model
           sequence number into msgpack bytes and fires `peer.deliver.remote(payload)`
           (a Ray actor call; user data is never pickled);
  phase 2: sends the hidden/residual tensors over torch.distributed point-to-point on the
           process group of the model replica (gloo on CPU, NCCL on CUDA).
The receiving actor's `deliver` hands the payload to `RayTransport.deliver`, which queues a
receive on that model's receive thread; the thread posts the matching `recv`s, and the
complete envelope is parked in the arrival buffer keyed by (model, batch id, stage) until the
engine loop drains it with `recv_ready()`. Engines run work in a different order than their
predecessors, so nothing here assumes arrival order equals execution order.

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
stream has finished. CPU: the gloo receives are posted as soon as the phase-1 call lands, and
the send/receive threads block in gloo's `wait()`, off the engine thread.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist

from paraflex.engine.transport import Envelope, Transport

WIRE_VERSION = 1
# gloo/NCCL tags: each tensor of a transfer gets seq * MAX_TENSORS + index (gloo matches on it;
# NCCL ignores tags and matches in order, which the per-model FIFO threads preserve).
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

def encode_phase1(env: Envelope, seq: int, replica: int | None) -> bytes:
    """msgpack bytes of one envelope's metadata and tensor descriptors (no tensor data)."""
    specs = None
    if env.tensors:
        if len(env.tensors) > MAX_TENSORS:
            raise ValueError(f"Envelope.tensors: {len(env.tensors)} tensors; at most {MAX_TENSORS}")
        specs = [[name, str(t.dtype), list(t.shape)] for name, t in env.tensors.items()]
    return msgpack.packb(
        {"v": WIRE_VERSION, "src": env.src, "dst": env.dst, "model": env.model, "kind": env.kind,
         "meta": env.meta, "seq": seq, "replica": replica, "tensors": specs},
        use_bin_type=True)


def decode_phase1(payload: bytes) -> tuple[Envelope, list | None, int, int | None]:
    """(envelope without tensors, tensor descriptors, seq, replica) from `encode_phase1` bytes."""
    d = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if d.get("v") != WIRE_VERSION:
        raise ValueError(f"phase-1 payload version {d.get('v')!r}; this engine speaks {WIRE_VERSION} "
                         "(all engines must run the same paraflex version)")
    env = Envelope(src=d["src"], dst=d["dst"], model=d["model"], kind=d["kind"], meta=d["meta"])
    return env, d["tensors"], d["seq"], d["replica"]


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
    bufs: list | None = None  # CPU: receive buffers and their posted gloo works
    works: list | None = None
    error: BaseException | None = None  # CPU: posting the receives failed


class _ModelLane:
    """The dedicated send thread and receive thread (and CUDA stream pair) of one model."""

    def __init__(self, owner: "RayTransport", model: str) -> None:
        self.owner = owner
        self.model = model
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.recv_q: queue.SimpleQueue = queue.SimpleQueue()
        self.recv_pending = 0  # guarded by owner._lock
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
        # The tensor sends are posted before the phase-1 call is submitted (submission costs
        # about a millisecond in Ray), so the receiver finds them in flight when it posts the
        # matching receives on the phase-1 arrival.
        env, owner = job.env, self.owner
        payload = encode_phase1(env, job.seq, job.replica)
        if not env.tensors:
            owner._phase1(env.dst, payload)
            return
        group = owner._group_for(env.model, env.src, env.dst, job.replica)
        tensors = list(env.tensors.values())
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

    # -- receive side ------------------------------------------------------------------------
    def post_cpu_receives(self, job: "_Incoming") -> None:
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
                if job.specs:
                    job.env.tensors = self._recv_tensors(job)
                self.owner._arrived(self, job)
            except BaseException as exc:  # noqa: BLE001 - reported, the lane keeps serving
                self.owner._dropped(self, job, exc)

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
    """

    def __init__(self, engine_id: int, device: str | torch.device = "cpu",
                 on_error: ErrorCallback | None = None, timeout_s: float = 30.0) -> None:
        self.engine_id = engine_id
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.on_error = on_error
        self.timeout_s = timeout_s
        self._peers: dict[int, Any] = {}
        self._groups: dict[tuple[str, int], _Group] = {}
        self._lanes: dict[str, _ModelLane] = {}
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
            current = self._groups.get((spec.model, spec.replica))
            if current is not None and current.spec.generation >= spec.generation:
                continue
            self._groups[(spec.model, spec.replica)] = _Group(
                spec, self.engine_id, self._store, self.backend, self.timeout_s)

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
        self._lanes.clear()
        self._groups.clear()

    # -- phase-1 arrival (called by the actor's `deliver` method) ----------------------------
    def deliver(self, payload: bytes) -> None:
        env, specs, seq, replica = decode_phase1(payload)
        if self._closed:
            return
        lane = self._lane(env.model)
        with self._cv:
            # Metadata-only messages skip the lane unless tensors of the same model are still in
            # flight, so they never overtake an earlier batch of that model.
            if not specs and lane.recv_pending == 0:
                self._ready[arrival_key(env, seq)] = env
                self._cv.notify_all()
                return
            lane.recv_pending += 1
        job = _Incoming(env, specs, seq, replica)
        if specs and lane.streams is None:
            try:
                lane.post_cpu_receives(job)
            except BaseException as exc:  # noqa: BLE001 - surfaces on the lane, in order
                job.error = exc
        lane.recv_q.put(job)

    # -- internals used by the lanes ---------------------------------------------------------
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

    def _phase1(self, dst: int, payload: bytes) -> None:
        peer = self._peers.get(dst)
        if peer is None:
            raise RuntimeError(f"engine {self.engine_id} has no handle for engine {dst}; "
                               "pass every engine to connect(peers=...)")
        # Fire and forget: a dead peer is detected by the controller's health monitor
        # (paraflex.ray_backend), which fails that replica's requests.
        peer.deliver.remote(payload)

    def _arrived(self, lane: _ModelLane, job: _Incoming) -> None:
        with self._cv:
            lane.recv_pending -= 1
            self._ready[arrival_key(job.env, job.seq)] = job.env
            self._cv.notify_all()

    def _dropped(self, lane: _ModelLane, job: _Incoming, exc: BaseException) -> None:
        with self._cv:
            lane.recv_pending -= 1
        self._report(lane.model, job.env.src, exc)

    def _report(self, model: str, peer: int, exc: BaseException) -> None:
        msg = f"engine {self.engine_id}: transfer of {model!r} with engine {peer} failed: {exc}"
        self.errors.append(msg)
        if self.on_error is not None:
            self.on_error(model, peer, exc)
