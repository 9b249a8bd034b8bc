"""What the engine scheduler queues: resident stages and the batches a later stage receives.

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) keeps, per resident (model,
stage), a `ResidentStage` with its queues (a first stage: waiting prompts and ready decodes;
a later stage: received batches, `PendingBatch`, by kind), found through `ResidentStages`. The
queues themselves (`Queue`, sorted by `arrival_key`) and their order across stages are
engine/core/queue_order.py's. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paraflex.engine.core.messages import BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.core.request import BLOCKED, SWAPPED_BLOCKED, StageRequest

if TYPE_CHECKING:
    from paraflex.engine.core.queue_order import Queue


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

    def remove(self, st: ResidentStage) -> None:
        self.all.remove(st)  # in place: the KV planner holds this very list
        del self._by_key[st.key]
        del self._by_model[st.model]

    def at(self, model: str, stage: int) -> ResidentStage | None:
        return self._by_key.get((model, stage))

    def of(self, model: str) -> ResidentStage | None:
        return self._by_model.get(model)

    def first_of(self, model: str) -> ResidentStage | None:
        """`model`'s first stage, if it is the stage resident here."""
        st = self._by_model.get(model)
        return st if st is not None and st.is_first else None


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
