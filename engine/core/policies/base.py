"""The policy interface: classes of queues in priority order, and how to serve one queue.

Place in the data flow: subclassed by the files beside it; called by `EngineScheduler.schedule`
(engine/core/scheduler.py), which passes itself as `sched`. A policy sees the scheduler through
`sched.order.pick_from_class(cls, now)` (the scheduler's `QueueOrder` keeps, per class, a heap of the
non-empty queues ordered by their head's arrival key, re-registered whenever a queue's head or
size changes, so a decision looks at class heads only: O(log queues), not a scan of every
resident stage), the batch formers `sched.first_stage` (engine/core/first_stage_batches.py) and
`sched.later_stage` (engine/core/later_stage_batches.py), and the settings `max_batch_size`,
`prefill_token_budget`, `prefill_max_requests`.

A policy also says which of the simulator's closed-form replays follow its decisions exactly
(`Policy.replay`, an `ExactReplay`): the ONE hook between a policy and the simulator's fast path
(simulator/fastpath/hook.py). A policy that names none is simulated step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paraflex.engine.core.scheduler import EngineScheduler, Queue, ResidentStage, ScheduledBatch


@dataclass(frozen=True)
class ExactReplay:
    """The simulator's closed-form replays (simulator/fastpath/) that follow a policy's decisions
    exactly; each is pinned by an equivalence test comparing whole runs with the step-by-step
    path, for every policy that names it.

    `decode_cycles`: the decode fast-forward (simulator/fastpath/fast_forward.py): a first-stage
    decode batch is formed again from the same requests while `QueueOrder.repeatable_decisions`
    says the policy's order picks its queue (tests/simulator/test_sim_fast_forward.py).
    `pipeline_group`: the joint replay of a pipeline's engines with the one-stage replicas on
    them (simulator/fastpath/joint_replay.py). It orders the queues by the policy's `class_of`
    (then head, after the starvation promotion) and serves them as `Policy.attempt` does: a
    first stage's whole decode queue (up to `max_batch_size`), a whole prompt, a received
    batch whole; so a policy naming it keeps `pick`, `attempt`, `first_decode` and
    `first_prefill` as they are here (tests/simulator/test_sim_joint_replay.py).
    """

    decode_cycles: bool = False
    pipeline_group: bool = False


class Policy:
    """Says which class each queue belongs to; the scheduler tries classes in index order."""

    name = ""
    num_classes = 1
    classify_on_len = False  # True if `class_of` depends on a queue's length, not just its head
    replay: ExactReplay | None = None  # the simulator's exact replays of this policy; None: step by step

    def class_of(self, queue: str, first_stage: bool, length: int, max_batch_size: int, num_stages: int = 1) -> int:
        """Class index (0 = first tried) of a non-empty queue: `queue` is its kind ("prefill",
        "decode", or "full": a later stage's full decode batches; `Queue.name`), `first_stage`
        whether it is a first stage's, `length` how many requests (first stage) or batches
        (later) it holds, `num_stages` its model's stage count. The scheduler's `QueueOrder`
        and the simulator's joint replay both order queues by it (the joint replay only for
        policies whose class does not depend on `num_stages`)."""
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
