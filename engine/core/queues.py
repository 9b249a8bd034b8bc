"""The engine scheduler's queues: resident stages, arrival-ordered queues, received batches.

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) keeps, per resident (model,
stage), a `ResidentStage` with its queues (a first stage: waiting prompts and ready decodes;
a later stage: received batches, `PendingBatch`, by kind). A `Queue` keeps its items sorted by
arrival key (`arrival_key`) and tells its `QueueOrder` (engine/core/queue_order.py, which makes
the queues and keeps the policy class heaps and the starvation ages) when it was served or its
head or size changed. Pure Python.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paraflex.engine.core.messages import BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.core.request import BLOCKED, SWAPPED_BLOCKED, StageRequest

if TYPE_CHECKING:
    from paraflex.engine.core.queue_order import QueueOrder


def arrival_key(item):
    """The sort key of a queued request or received batch: (arrival, sequence number)."""
    return item.key


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

    def enter_inflight(self, req: StageRequest, batch_id: str, decode: bool) -> None:
        """First stage: `req` ran in `batch_id` (a decode or mixed batch when `decode`; the
        in-flight bound counts those) and now awaits its token."""
        req.batch_id = batch_id
        self.inflight[batch_id] = self.inflight.get(batch_id, 0) + 1
        if decode:
            self.decode_inflight.add(batch_id)

    def leave_inflight(self, req: StageRequest) -> None:
        """First stage: `req` no longer awaits the token of the batch it ran in (it came, or
        the request ended)."""
        if self.is_first and req.state in (BLOCKED, SWAPPED_BLOCKED) and req.batch_id is not None:
            n = self.inflight.get(req.batch_id, 0) - 1
            if n > 0:
                self.inflight[req.batch_id] = n
            else:
                self.inflight.pop(req.batch_id, None)
                self.decode_inflight.discard(req.batch_id)
            req.batch_id = None


class ResidentStages:
    """The stages resident on one engine (`all`, in the order they were added), found by
    (model, stage) or by model: one engine hosts at most one stage of a model."""

    def __init__(self):
        self.all: list[ResidentStage] = []
        self._by_key: dict[tuple[str, int], ResidentStage] = {}
        self._by_model: dict[str, ResidentStage] = {}

    def add(self, st: ResidentStage) -> None:
        self.all.append(st)
        self._by_key[st.key] = st
        self._by_model[st.model] = st

    def at(self, model: str, stage: int) -> ResidentStage | None:
        return self._by_key.get((model, stage))

    def of(self, model: str) -> ResidentStage | None:
        return self._by_model.get(model)

    def first_of(self, model: str) -> ResidentStage | None:
        """`model`'s first stage, if it is the stage resident here."""
        st = self._by_model.get(model)
        return st if st is not None and st.is_first else None


class Queue:
    """Items sorted by arrival key, plus the decision index it last was served/became non-empty.

    Every change of `since` also goes on its order's ages heap, so that finding starving
    queues costs O(1) per decision while none starves.
    """

    __slots__ = ("items", "since", "stage", "name", "order", "reg")

    def __init__(self, stage: ResidentStage, name: str, order: "QueueOrder"):
        self.items: list = []
        self.since = 0
        self.stage = stage
        self.name = name
        self.order = order
        self.reg: tuple | None = None  # (class, head key, tick) of its live entry in a class heap

    def touch(self, decision: int) -> None:
        """Mark the queue served (or newly non-empty) at `decision`."""
        self.since = decision
        self.order.aged(self, decision)

    def push(self, item, decision: int) -> None:
        if not self.items:
            self.touch(decision)
        insort(self.items, item, key=arrival_key)
        if self.items[0] is item or self.order.classify_on_len:
            self.order.requeue(self)

    def pop_front(self, n: int) -> None:
        del self.items[:n]
        self.order.requeue(self)

    def remove(self, item) -> None:
        self.items.remove(item)
        self.order.requeue(self)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"Queue({self.stage.model}/{self.stage.stage}.{self.name}, {len(self.items)})"


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
