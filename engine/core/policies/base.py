"""The policy interface: classes of queues in priority order, and how to serve one queue.

Place in the data flow: subclassed by the files beside it; called by `EngineScheduler.schedule`
(engine/core/scheduler.py), which passes itself as `sched`. A policy sees the scheduler through
`sched.order.pick_from_class(cls, now)` (the scheduler's `QueueOrder` keeps, per class, a heap of the
non-empty queues ordered by their head's arrival key, re-registered whenever a queue's head or
size changes, so a decision looks at class heads only: O(log queues), not a scan of every
resident stage), the batch formers `sched.first_stage` (engine/core/first_stage_batches.py) and
`sched.later_stage` (engine/core/later_stage_batches.py), and the settings `max_batch_size`,
`prefill_token_budget`, `prefill_max_requests`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paraflex.engine.core.scheduler import EngineScheduler, Queue, ResidentStage, ScheduledBatch


class Policy:
    """Says which class each queue belongs to; the scheduler tries classes in index order."""

    name = ""
    num_classes = 1
    classify_on_len = False  # True if `classify` depends on a queue's length, not just its head

    def classify(self, sched: "EngineScheduler", q: "Queue") -> int:
        """Class index (0 = first tried) of a non-empty queue."""
        raise NotImplementedError

    def pick(self, sched: "EngineScheduler", now: float) -> "ScheduledBatch | None":
        """Classes in order; within a class, queues by oldest head; the first batch formed wins."""
        for cls in range(self.num_classes):
            batch = sched.order.pick_from_class(cls, now)
            if batch is not None:
                return batch
        return None

    def attempt(self, sched: "EngineScheduler", q: "Queue", now: float) -> "ScheduledBatch | None":
        """Form a batch from queue `q` (also used by the starvation promotion)."""
        st = q.stage
        if not st.is_first:
            return sched.later_stage.run_oldest(st, q, now)
        if q is st.decode_q:
            return self.first_decode(sched, st, now)
        return self.first_prefill(sched, st, now)

    def default_prefill_max_requests(self, max_batch_size: int) -> int:
        """Prompts per prefill batch when the config does not say."""
        return 1

    def first_decode(self, sched: "EngineScheduler", st: "ResidentStage", now: float) -> "ScheduledBatch | None":
        """Serve a first stage's decode queue: up to `max_batch_size` oldest ready requests."""
        return sched.first_stage.decode(st, sched.max_batch_size, now)

    def first_prefill(self, sched: "EngineScheduler", st: "ResidentStage", now: float) -> "ScheduledBatch | None":
        """Serve a first stage's prefill queue."""
        return sched.first_stage.prefill(st, now, sched.prefill_token_budget, sched.prefill_max_requests)
