"""The engine scheduler's queues: resident stages, arrival-ordered queues, received batches.

Place in the data flow: `EngineScheduler` (engine/scheduler.py) keeps, per resident (model,
stage), a `ResidentStage` with its queues (a first stage: waiting prompts and ready decodes;
a later stage: received batches, `PendingBatch`, by kind). A `Queue` keeps its items sorted by
arrival key and tells its owner when its head or size changes (the policy class heaps and the
starvation ages live on the scheduler, engine/queue_heaps.py). Pure Python.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from heapq import heappush
from itertools import count
from typing import TYPE_CHECKING

from paraflex.engine.messages import BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.request import StageRequest

if TYPE_CHECKING:
    from paraflex.engine.scheduler import EngineScheduler

_TICK = count()  # unique tie-break for the ages heap


@dataclass
class ResidentStage:
    """One stage of one model resident on this engine, with its queues."""

    model: str
    stage: int
    num_layers: int
    kv_bytes_per_token_per_layer: int
    num_stages: int
    tokens_per_block: int = 0
    # first stage: requests; later stages: PendingBatch objects; all sorted by arrival key
    prefill_q: "Queue" = field(default=None, repr=False)
    decode_q: "Queue" = field(default=None, repr=False)  # first stage: ready decodes; later: under-sized batches
    full_q: "Queue" = field(default=None, repr=False)  # later stages: full decode batches
    inflight: dict[str, int] = field(default_factory=dict, repr=False)  # first stage: batch_id -> requests awaiting a token
    # first stage: ids of the decode (or mixed) batches among `inflight` (the in-flight bound counts these)
    decode_inflight: set[str] = field(default_factory=set, repr=False)
    key: tuple[str, int] = field(init=False, repr=False)
    is_first: bool = field(init=False, repr=False)
    is_last: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.key = (self.model, self.stage)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1

    def queues(self) -> tuple["Queue", ...]:
        return (self.prefill_q, self.decode_q) if self.is_first else (self.full_q, self.decode_q, self.prefill_q)


class Queue:
    """Items sorted by arrival key, plus the decision index it last was served/became non-empty.

    Every change of `since` also goes on the engine's `ages` heap, so that finding starving
    queues costs O(1) per decision while none starves.
    """

    __slots__ = ("items", "since", "stage", "name", "owner", "reg")

    def __init__(self, stage: ResidentStage, name: str, owner: "EngineScheduler"):
        self.items: list = []
        self.since = 0
        self.stage = stage
        self.name = name
        self.owner = owner
        self.reg: tuple | None = None  # (class, head key, tick) of its live entry in a class heap

    def touch(self, decision: int) -> None:
        """Mark the queue served (or newly non-empty) at `decision`."""
        self.since = decision
        heappush(self.owner._ages, (decision, next(_TICK), self))

    def push(self, item, decision: int) -> None:
        if not self.items:
            self.touch(decision)
        insort(self.items, item, key=_key)
        if self.items[0] is item or self.owner._classify_on_len:
            self.owner._requeue(self)

    def pop_front(self, n: int) -> None:
        del self.items[:n]
        self.owner._requeue(self)

    def remove(self, item) -> None:
        self.items.remove(item)
        self.owner._requeue(self)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"Queue({self.stage.model}/{self.stage.stage}.{self.name}, {len(self.items)})"


def _key(item):
    return item.key


class PendingBatch:
    """A batch received from upstream at a later stage, kept whole until it runs."""

    __slots__ = ("msg", "prefills", "decodes", "key", "seq", "rows", "dropped", "queue")

    def __init__(self, msg: BatchMessage, seq: int):
        self.msg = msg
        self.prefills: list[tuple[StageRequest, PrefillEntry]] = []
        self.decodes: list[tuple[StageRequest, DecodeEntry]] = []
        self.seq = seq
        self.key = (float("inf"), seq)
        self.rows: list[tuple[int, int]] = []  # received tensor rows of each live member
        self.dropped = False
        self.queue: Queue | None = None  # the queue it waits in

    def members(self) -> list[StageRequest]:
        return [r for r, _ in self.prefills] + [r for r, _ in self.decodes]

    def __len__(self) -> int:
        return len(self.prefills) + len(self.decodes)
