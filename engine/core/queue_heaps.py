"""Which queue an engine serves next: the policy's class heaps and the starvation promotion.

Place in the data flow: a mixin of `EngineScheduler` (engine/core/scheduler.py), split out so that
the queue-ordering bookkeeping lives in one file. Each policy class keeps its non-empty queues
in a heap ordered by head key (`_requeue` re-registers a queue when its head or size changes;
`pick_from_class` tries them oldest head first); `_serve_starving` promotes queues not served
for more than the starvation limit (see engine/core/scheduler.py's docstring for the guarantee);
`repeatable_decisions` tells the simulator's fast-forward how long a decision would repeat.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from paraflex.engine.core.queues import _TICK, Queue

if TYPE_CHECKING:
    from paraflex.engine.core.scheduled import ScheduledBatch

_UNBOUNDED = 1 << 62  # repeatable_decisions: no other queue can interrupt


class QueueHeaps:
    """Queue selection for `EngineScheduler` (uses its stages, policy, decisions and heaps)."""

    # --- class heaps: each policy class keeps its non-empty queues ordered by head key -------
    def _requeue(self, q: Queue) -> None:
        """Re-register `q` in its policy class heap after its head or size changed."""
        if not q.items:
            q.reg = None
            return
        cls = self.policy.classify(self, q)
        key = q.items[0].key
        reg = q.reg
        if reg is not None and reg[0] == cls and reg[1] == key:
            return
        tick = next(_TICK)
        q.reg = (cls, key, tick)
        heap = self._heaps[cls]
        heappush(heap, (key, tick, q))
        if len(heap) > 4 * (len(self.stages) + 16):
            heap[:] = [e for e in heap if e[2].reg is not None and e[2].reg[2] == e[1]]
            heapify(heap)

    def pick_from_class(self, cls: int, now: float) -> ScheduledBatch | None:
        """Try the queues of one policy class, oldest head first; the first batch formed wins."""
        heap = self._heaps[cls]
        attempt = self.policy.attempt
        skipped = []
        batch = None
        while heap:
            entry = heap[0]
            reg = entry[2].reg
            if reg is None or reg[2] != entry[1]:
                heappop(heap)  # stale: the queue changed since
                continue
            batch = attempt(self, entry[2], now)
            if batch is not None:
                self._last_pick = (cls, entry[0], entry[2])
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
        return self._starvation_auto

    def _serve_starving(self, now: float) -> ScheduledBatch | None:
        ages = self._ages
        # drop stale heap entries (the queue was touched again, or emptied) from the top
        while ages and (ages[0][2].since != ages[0][0] or not ages[0][2].items):
            heappop(ages)
        if len(ages) > 8 * (len(self.stages) + 8):
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
            batch = self.policy.attempt(self, q, now)
            if batch is not None:
                self.stats["starvation_promotions"] += 1
                break
        for entry in popped.values():  # still starving (the served queue got a fresh entry)
            if entry[2].since == entry[0] and entry[2].items:
                heappush(ages, entry)
        return batch

    def repeatable_decisions(self, batch: ScheduledBatch) -> int:
        """For a first-stage decode batch `schedule` just formed: how many further decisions in
        a row would form it again from the same requests, if they were back in their decode
        queue and every other queue stayed as it is now. Each of those decisions tries that
        queue first when every other non-empty queue comes later in the policy's order (class,
        then head key); it ends when another queue would be promoted for starvation. 0 when
        this cannot be shown (the batch came from a promotion, or another queue comes first)."""
        st = self._by_key[(batch.model, batch.stage)]
        if st.decode_q.items:
            return 0
        others = [q for x in self.stages for q in x.queues() if q.items]
        if not others:
            return _UNBOUNDED
        pick = self._last_pick
        if pick is None or pick[2] is not st.decode_q:
            return 0
        mine = (pick[0], pick[1])
        for q in others:
            if q.reg is None or (q.reg[0], q.reg[1]) < mine:
                return 0
        limit = self.effective_starvation_limit
        if self.starvation_limit == 0:
            return _UNBOUNDED
        # decision j after this one runs with d = decisions + j - 1; q is promoted once d - q.since > limit
        return max(0, min(q.since for q in others) + limit + 1 - self.decisions)
