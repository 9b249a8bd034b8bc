"""Process groups of the Ray transport: one torch.distributed group per model replica.

Where it sits: the controller (paraflex.serving.ray_startup) starts the rendezvous store with
`start_store`; every engine's `RayTransport.connect` (paraflex.engine.transport.ray) builds a
`ReplicaGroup` for each `GroupSpec` it belongs to and keeps them in its `ReplicaGroups`, where
the model's send/receive lanes
(paraflex.engine.transport.ray_lanes) look up the group of a hop; they and the slot inboxes
(paraflex.engine.transport.ray_slots) move phase-2 tensors over it.

One group per model replica, over the engines the replica spans (paper §6.3: "unique process
groups among the workers where the model is deployed"). Each group is its own
`ProcessGroupGloo`/`ProcessGroupNCCL` built from a shared TCPStore under a prefix naming the
model, replica and generation, not a `new_group` of one global world: a global world cannot
re-admit a restarted rank, whereas a per-replica group is rebuilt alone (next generation) when
one of its engines comes back, and one model's traffic never queues behind another model's on
a shared communicator. Per-hop pairs would need one group per stage boundary for the same
isolation; a replica group already gives each hop its own gloo pair (full mesh) or NCCL p2p
communicator (created lazily per rank pair).

Gloo's pairs listen where the group's device says: on a loopback store (a local Ray instance
whose gateway is on loopback, paraflex.serving.ray_startup.bind_host) the device is bound to
that loopback address, so the tensors' sockets are not reachable from the network either;
otherwise gloo binds the address the node's hostname resolves to, as torch does by default.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paraflex.engine.transport.ray_slots import SlotInbox, slot_tag
from paraflex.engine.transport.ray_wire import MAX_TENSORS, TAG_SPACE


def is_loopback(host: str) -> bool:
    """Whether `host` reaches this machine only (127.x, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    """The rendezvous store every process group is built from (held by the controller),
    listening on `host` only (torch's own server would listen on every interface, and any
    client that reaches it can read and write keys)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60), master_listen_fd=listener.detach())
    return store, port


class ReplicaGroup:
    """One built process group plus this engine's rank in it."""

    def __init__(self, spec: GroupSpec, engine_id: int, store: dist.Store, backend: str,
                 timeout_s: float, store_host: str | None = None) -> None:
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
        elif store_host is not None and is_loopback(store_host):
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=store_host)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)
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

    def fits_slots(self, src: int, dst: int, tensors: list[torch.Tensor], slot_bytes: int) -> bool:
        """Whether this transfer goes into the receiver's pre-posted slots of `slot_bytes` each
        (0: none posted): the receiver is the next stage of the replica (the only hop it posts
        slots for) and each tensor fits one."""
        return (slot_bytes > 0 and self.neighbour(src, +1) == dst
                and all(0 < t.nbytes <= slot_bytes for t in tensors))

    def send_slots(self, tensors: list[torch.Tensor], dst: int, first: int) -> list:
        """Send each tensor into the successor's pre-posted slot first, first+1, ..."""
        return [self.pg.send([t], self.rank_of[dst], slot_tag(first + i))
                for i, t in enumerate(tensors)]


class ReplicaGroups:
    """This engine's built process groups by (model, replica): which group carries a hop.

    Written by `RayTransport.connect`, read by the transport and its lanes' threads (a dict
    lookup; a rebuilt group replaces its entry whole)."""

    def __init__(self) -> None:
        self._by_replica: dict[tuple[str, int], ReplicaGroup] = {}

    def get(self, model: str, replica: int) -> ReplicaGroup | None:
        return self._by_replica.get((model, replica))

    def install(self, group: ReplicaGroup) -> ReplicaGroup | None:
        """Add `group`; returns the group of the same replica it replaces, if any."""
        key = (group.spec.model, group.spec.replica)
        old = self._by_replica.get(key)
        self._by_replica[key] = group
        return old

    def remove_on(self, model: str, engines: tuple[int, ...]) -> ReplicaGroup | None:
        """Forget the group of `model`'s replica over exactly `engines` (a replica removed by a
        live placement change), so no later hop finds it; returns it, or None."""
        for key, group in list(self._by_replica.items()):
            if key[0] == model and group.spec.engines == tuple(engines):
                return self._by_replica.pop(key)
        return None

    def all(self) -> list[ReplicaGroup]:
        return list(self._by_replica.values())

    def clear(self) -> None:
        self._by_replica.clear()

    def generations(self) -> dict[str, int]:
        """"model/replica" -> generation of its built group."""
        return {f"{m}/{r}": g.spec.generation for (m, r), g in self._by_replica.items()}

    def replica_joining(self, model: str, src: int, dst: int) -> int | None:
        """The first replica of `model` whose group holds both engines, if any."""
        for (m, replica), group in self._by_replica.items():
            if m == model and src in group.rank_of and dst in group.rank_of:
                return replica
        return None

    def for_hop(self, model: str, src: int, dst: int, replica: int | None) -> ReplicaGroup:
        """The group of `model`'s `replica` that joins engines src and dst; raises
        RuntimeError if this engine has none."""
        group = self._by_replica.get((model, replica)) if replica is not None else None
        if group is None or src not in group.rank_of or dst not in group.rank_of:
            raise RuntimeError(
                f"no process group of model {model!r} joins engines {src} and {dst}; "
                "connect() must be given the GroupSpec of every replica this engine hosts")
        return group
