"""Which queue an engine serves next: the queues, the policy's class heaps, the starvation promotion.

Place in the data flow: one `QueueOrder` per `EngineScheduler` (engine/core/scheduler.py). It
makes every queue of the engine's resident stages (`attach`; a `Queue` keeps its items sorted by
arrival key and reports to it) and counts the engine's decisions.
Each policy class keeps its non-empty queues in a heap ordered by head key (`requeue`
re-registers a queue when its head or size changes; `pick_from_class` tries them oldest head
first); `serve_starving` promotes queues not served for more than the starvation limit (the
guarantee below); `repeatable_decisions` tells the
simulator's fast-forward how long a decision would repeat. The policy is consulted through its
`class_of` (a queue's class) and an `attempt(queue, now) -> batch or None` callable (`follow`).

No model starves (guarantee)
----------------------------
Every queue (a first stage's prefill queue and decode queue; a later stage's full-decode,
under-sized-decode and prefill batch queues) records the decision at which it last was served
or became non-empty. A non-empty queue not served for more than L decisions jumps ahead of the
policy's class order; starving queues go oldest head first. L is `starvation_limit`, by default
max(64, 4 x the number of queues on the engine) so that the policy's order rules in normal
operation; 0 disables the promotion. A served queue cannot starve again for L decisions, so
with L >= Q (the number of queues on the engine; the default ensures it) a queue whose head can
get KV is served within L + Q decisions, whatever other models do. Within a queue the oldest
request/batch goes first, and a first-stage decode batch takes up to `max_batch_size` of them.
A chatty small model beside a large one therefore cannot hold back the large model's
under-sized decode batches for ever (tests/engine/core/test_scheduler_starvation.py).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from heapq import heapify, heappop, heappush
from itertools import count
from typing import TYPE_CHECKING

from paraflex.engine.core.queues import ResidentStage, arrival_key

if TYPE_CHECKING:
    from paraflex.engine.core.policies.base import Policy
    from paraflex.engine.core.scheduled import ScheduledBatch

    Attempt = Callable[["Queue", float], "ScheduledBatch | None"]

UNBOUNDED = 1 << 62  # repeatable_decisions: no other queue can interrupt


class Queue:
    """Items sorted by arrival key, plus the decision index it last was served/became non-empty.

    Every change of `since` also goes on its order's ages heap, so that finding starving
    queues costs O(1) per decision while none starves; a change of its head or size
    re-registers it in its class heap (`QueueOrder.requeue`).
    """

    __slots__ = ("items", "since", "stage", "name", "order", "reg")

    def __init__(self, stage: ResidentStage, name: str, order: QueueOrder):
        self.items: list = []
        self.since = 0
        self.stage = stage
        self.name = name
        self.order = order
        self.reg: tuple | None = None  # (class, head key, tick) of its live entry in a class heap

    def touch(self, decision: int) -> None:
        """Mark the queue served (or newly non-empty) at `decision`."""
        self.since = decision
        order = self.order
        heappush(order._ages, (decision, next(order._tick), self))

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


class QueueOrder:
    """The queues of one engine, their policy class heaps and starvation ages, and the
    engine's decision count (`decisions`: how many batches `schedule` has formed)."""

    def __init__(self, starvation_limit: int | None):
        self.starvation_limit = starvation_limit
        self.decisions = 0
        self.promotions = 0  # batches served by a starvation promotion
        self.queues: list[Queue] = []
        self.num_stages = 0
        self._auto_limit = 64  # the starvation limit when `starvation_limit` is None
        self.last_pick: tuple | None = None  # (class, head key, queue) of the last policy pick; None if promoted
        self._ages: list = []  # heap of (since, tick, queue): see Queue
        self._heaps: list[list] = []  # per policy class: (head key, tick, queue)
        self._tick = count()  # unique tie-break and registration stamp for both heaps
        self.class_of: Callable[[str, bool, int, int, int], int] = None
        self.attempt: Attempt = None
        self.classify_on_len = False
        self.max_batch_size = 0

    def follow(self, policy: Policy, attempt: Attempt, max_batch_size: int) -> None:
        """Order the queues by `policy`: its `class_of` gives a non-empty queue's class (0 is
        tried first; with `classify_on_len` it may change with the queue's length, not only
        its head); `attempt` serves a queue as the policy does (a batch, or None if it cannot
        run now)."""
        self.class_of, self.attempt, self.classify_on_len = policy.class_of, attempt, policy.classify_on_len
        self.max_batch_size = max_batch_size
        self._heaps = [[] for _ in range(policy.num_classes)]
        for q in self.queues:
            q.reg = None
            self.requeue(q)

    def attach(self, st: ResidentStage) -> None:
        """Make the queues of a newly resident stage (a first stage: prompts and decodes; a
        later stage: full decode, under-sized decode and prefill batches)."""
        if st.is_first:
            st.prefill_q, st.decode_q = Queue(st, "prefill", self), Queue(st, "decode", self)
        else:
            st.full_q, st.decode_q, st.prefill_q = Queue(st, "full", self), Queue(st, "decode", self), Queue(st, "prefill", self)
        self.queues.extend(st.queues())
        self.num_stages += 1
        self._auto_limit = max(64, 4 * len(self.queues))

    def detach(self, st: ResidentStage) -> None:
        """Drop the queues of a stage that leaves the engine (its heap entries go stale)."""
        for q in st.queues():
            q.items.clear()
            q.reg = None
            self.queues.remove(q)
        self.num_stages -= 1
        self._auto_limit = max(64, 4 * len(self.queues))

    # --- what a Queue reports -------------------------------------------------------------
    def requeue(self, q: Queue) -> None:
        """Re-register `q` in its policy class heap after its head or size changed."""
        if not q.items:
            q.reg = None
            return
        cls = self.class_of(q.name, q.stage.is_first, len(q.items), self.max_batch_size, q.stage.num_stages)
        key = q.items[0].key
        reg = q.reg
        if reg is not None and reg[0] == cls and reg[1] == key:
            return
        tick = next(self._tick)
        q.reg = (cls, key, tick)
        heap = self._heaps[cls]
        heappush(heap, (key, tick, q))
        if len(heap) > 4 * (self.num_stages + 16):
            heap[:] = [e for e in heap if e[2].reg is not None and e[2].reg[2] == e[1]]
            heapify(heap)

    # --- choosing a queue -----------------------------------------------------------------
    def pick_from_class(self, cls: int, now: float) -> ScheduledBatch | None:
        """Try the queues of one policy class, oldest head first; the first batch formed wins."""
        heap = self._heaps[cls]
        attempt = self.attempt
        skipped = []
        batch = None
        while heap:
            entry = heap[0]
            reg = entry[2].reg
            if reg is None or reg[2] != entry[1]:
                heappop(heap)  # stale: the queue changed since
                continue
            batch = attempt(entry[2], now)
            if batch is not None:
                self.last_pick = (cls, entry[0], entry[2])
                break
            skipped.append(heappop(heap))
        for entry in skipped:
            heappush(heap, entry)
        return batch

    @property
    def effective_starvation_limit(self) -> int:
        """`starvation_limit`, or when it is None: max(64, 4 x the number of queues)."""
        if self.starvation_limit is not None:
            return self.starvation_limit
        return self._auto_limit

    def serve_starving(self, now: float) -> ScheduledBatch | None:
        """A batch from the queue with the oldest head among those not served for more than
        the starvation limit (None: none starves, or none of them can run now). Also forgets
        the last policy pick: a decision starts here."""
        self.last_pick = None
        if self.starvation_limit == 0:
            return None
        ages = self._ages
        # drop stale heap entries (the queue was touched again, or emptied) from the top
        while ages and (ages[0][2].since != ages[0][0] or not ages[0][2].items):
            heappop(ages)
        if len(ages) > 8 * (self.num_stages + 8):
            ages[:] = [a for a in ages if a[2].since == a[0] and a[2].items]
            heapify(ages)
        limit = self.effective_starvation_limit
        d = self.decisions
        if not ages or d - ages[0][0] <= limit:
            return None
        popped = {}  # id(queue) -> its live entry (a queue touched twice in one decision: keep one)
        while ages and d - ages[0][0] > limit:
            entry = heappop(ages)
            if entry[2].since == entry[0] and entry[2].items:
                popped[id(entry[2])] = entry
        batch = None
        for q in sorted((e[2] for e in popped.values()), key=lambda q: q.items[0].key):
            batch = self.attempt(q, now)
            if batch is not None:
                self.promotions += 1
                break
        for entry in popped.values():  # still starving (the served queue got a fresh entry)
            if entry[2].since == entry[0] and entry[2].items:
                heappush(ages, entry)
        return batch

    def repeatable_decisions(self, st: ResidentStage) -> int:
        """For a first-stage decode batch of `st` that `schedule` just formed: how many further
        decisions in a row would form it again from the same requests, if they were back in
        their decode queue and every other queue stayed as it is now. Each of those decisions
        tries that queue first when every other non-empty queue comes later in the policy's
        order (class, then head key); it ends when another queue would be promoted for
        starvation. 0 when this cannot be shown (the batch came from a promotion, or another
        queue comes first)."""
        if st.decode_q.items:
            return 0
        others = [q for q in self.queues if q.items]
        if not others:
            return UNBOUNDED
        pick = self.last_pick
        if pick is None or pick[2] is not st.decode_q:
            return 0
        mine = (pick[0], pick[1])
        for q in others:
            if q.reg is None or (q.reg[0], q.reg[1]) < mine:
                return 0
        limit = self.effective_starvation_limit
        if self.starvation_limit == 0:
            return UNBOUNDED
        # decision j after this one runs with d = decisions + j - 1; q is promoted once d - q.since > limit
        return max(0, min(q.since for q in others) + limit + 1 - self.decisions)
