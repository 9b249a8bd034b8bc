"""Process groups of the Ray transport: one torch.distributed group per model replica.

Where it sits: the controller (paraflex.serving.ray_startup) starts the rendezvous store with
`start_store`; every engine's `RayTransport.connect` (paraflex.engine.transport.ray) builds a
`_Group` for each `GroupSpec` it belongs to; the model's send/receive lanes
(paraflex.engine.transport.ray_lanes) and the slot inboxes (paraflex.engine.transport.ray_slots) move
phase-2 tensors over it.

One group per model replica, over the engines the replica spans (paper §6.3: "unique process
groups among the workers where the model is deployed"). Each group is its own
`ProcessGroupGloo`/`ProcessGroupNCCL` built from a shared TCPStore under a prefix naming the
model, replica and generation, not a `new_group` of one global world: a global world cannot
re-admit a restarted rank, whereas a per-replica group is rebuilt alone (next generation) when
one of its engines comes back, and one model's traffic never queues behind another model's on
a shared communicator. Per-hop pairs would need one group per stage boundary for the same
isolation; a replica group already gives each hop its own gloo pair (full mesh) or NCCL p2p
communicator (created lazily per rank pair).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paraflex.engine.transport.ray_slots import SlotInbox, slot_tag
from paraflex.engine.transport.ray_wire import MAX_TENSORS, TAG_SPACE

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

