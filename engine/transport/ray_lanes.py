"""Per-model lanes of the Ray transport: one send thread and one receive thread per model.

Where it sits: `RayTransport.send` (paraflex.engine.transport.ray) numbers an envelope and
queues it on its model's lane; the lane's send thread does phase 1 (the msgpack metadata of
paraflex.engine.transport.ray_wire in a Ray actor call) and phase 2 (the tensors over the model
replica's process group, paraflex.engine.transport.ray_groups), either into the successor's
pre-posted slots (paraflex.engine.transport.ray_slots) or the rendezvous way. On the receiving
engine, `RayTransport.deliver` posts the rendezvous receives on the phase-1 call
(`post_cpu_receives`) and queues the wait on the lane's receive thread, which hands the
finished arrival back to the transport (`LaneLinks.on_received`) to be released in arrival
order. A lane sees its transport only through `LaneLinks`: the device, the slot size, the
replica groups, the phase-1 call, and the two callbacks.
Separate threads per model keep one model's transfers from queuing behind another's. On CUDA
each lane also owns a stream pair (send, receive).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paraflex.engine.transport.base import Envelope
from paraflex.engine.transport.ray_groups import ReplicaGroups
from paraflex.engine.transport.ray_slots import PACK_BYTES, pack, pack_offsets
from paraflex.engine.transport.ray_wire import WIRE_DTYPES, encode_phase1


@dataclass
class OutgoingTransfer:
    """An envelope queued on its model's send thread, numbered by the transport."""

    env: Envelope
    seq: int
    replica: int | None
    ready_event: Any = None  # torch.cuda.Event on the producer's stream (GPU)


@dataclass
class IncomingTransfer:
    """A phase-1 arrival waiting for its tensors (from slots or lane receives), in its
    model's arrival order until released."""

    env: Envelope
    specs: list | None
    seq: int
    replica: int | None
    bufs: list | None = None  # CPU: receive buffers (rendezvous: posted; slots: as they land)
    works: list | None = None  # CPU rendezvous: the posted gloo works
    missing: int = 0  # slots: buffers not landed yet
    packed: bool = False  # slots: all tensors in one slot (ray_slots.pack)
    done: bool = False  # tensors complete (or failed): may leave the lane's arrival order
    error: BaseException | None = None


@dataclass(frozen=True)
class LaneLinks:
    """All a lane uses of the transport endpoint that owns it.

    `slot_bytes` is the size of the successor's pre-posted slots (0: none, e.g. CUDA);
    `send_phase1(dst, payload)` makes the phase-1 actor call to engine dst; `on_received(lane,
    job)` takes back an incoming transfer whose rendezvous receive finished or failed (it sets
    `job.done` and releases under the transport's lock); `on_failed(model, peer, exc)` reports
    a failed send."""

    device: torch.device
    slot_bytes: int
    groups: ReplicaGroups
    send_phase1: Callable[[int, bytes], None]
    on_received: Callable[["ModelLane", IncomingTransfer], None]
    on_failed: Callable[[str, int, BaseException], None]


class ModelLane:
    """The dedicated send thread and receive thread (and CUDA stream pair) of one model.

    `order` holds this model's phase-1 arrivals that are not released yet, in arrival order;
    an arrival is released into the arrival buffer once it and all before it are complete, so
    a metadata-only message never overtakes an earlier batch of the model (guarded by the
    transport's lock)."""

    def __init__(self, links: LaneLinks, model: str) -> None:
        self.links = links
        self.model = model
        self.send_q: queue.SimpleQueue = queue.SimpleQueue()
        self.recv_q: queue.SimpleQueue = queue.SimpleQueue()
        self.order: deque[IncomingTransfer] = deque()
        self.next_seq = 0
        self.streams = None
        if links.device.type == "cuda":
            self.streams = (torch.cuda.Stream(links.device), torch.cuda.Stream(links.device))
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
                self.links.on_failed(self.model, job.env.dst, exc)

    def _send_one(self, job: OutgoingTransfer) -> None:
        env, links = job.env, self.links
        if not env.tensors:
            links.send_phase1(env.dst, encode_phase1(env, job.seq, job.replica))
            return
        group = links.groups.for_hop(env.model, env.src, env.dst, job.replica)
        tensors = list(env.tensors.values())
        if self.streams is None and group.fits_slots(env.src, env.dst, tensors, links.slot_bytes):
            # Into pre-posted slots gloo writes the bytes inside `send` (about 1.7 ms for
            # 2.4 MB here), so phase 1 is submitted first and is on its way meanwhile
            # (measured: prefill hop 4.1-4.6 ms vs 4.8-5.1 ms with the data sent first).
            packed = (len(tensors) > 1 and pack_offsets([t.nbytes for t in tensors])[1]
                      <= min(PACK_BYTES, links.slot_bytes))
            if packed:
                tensors = [pack(tensors)]
            first = group.next_slot
            group.next_slot += len(tensors)
            links.send_phase1(env.dst, encode_phase1(env, job.seq, job.replica,
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
            links.send_phase1(env.dst, payload)
            for work in works:
                work.wait()
            return
        send_stream = self.streams[0]
        with torch.cuda.stream(send_stream):
            send_stream.wait_event(job.ready_event)
            works = group.send(tensors, env.dst, job.seq)
            links.send_phase1(env.dst, payload)
            for work in works:
                work.wait()
        send_stream.synchronize()  # keep `tensors` alive until NCCL has read them

    # -- receive side (rendezvous) -----------------------------------------------------------
    def post_cpu_receives(self, job: IncomingTransfer) -> None:
        """Post the gloo receives at once (on the phase-1 call); the lane thread waits."""
        group = self.links.groups.for_hop(job.env.model, job.env.src, job.env.dst, job.replica)
        job.bufs = [torch.empty(s[2], dtype=WIRE_DTYPES[s[1]]) for s in job.specs]
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
            self.links.on_received(self, job)

    def _recv_tensors(self, job: IncomingTransfer) -> dict[str, torch.Tensor]:
        names = [s[0] for s in job.specs]
        if self.streams is None:
            if job.error is not None:
                raise job.error
            for work in job.works:
                work.wait()
            return dict(zip(names, job.bufs))
        group = self.links.groups.for_hop(job.env.model, job.env.src, job.env.dst, job.replica)
        recv_stream = self.streams[1]
        with torch.cuda.stream(recv_stream):
            bufs = [torch.empty(s[2], dtype=WIRE_DTYPES[s[1]], device=self.links.device)
                    for s in job.specs]
            for work in group.recv(bufs, job.env.src, job.seq):
                work.wait()
        recv_stream.synchronize()  # "fully arrived": the consumer may use them on any stream
        return dict(zip(names, bufs))
