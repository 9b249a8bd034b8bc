"""The policy interface and the shared "try candidates oldest first" helper.

Place in the data flow: subclassed by the files beside it; called by `EngineScheduler.schedule`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from paraflex.engine.scheduler import EngineScheduler, Queue, ResidentStage, ScheduledBatch


class Policy:
    """Orders an engine's candidate batches; the scheduler forms them."""

    name = ""

    def pick(self, sched: "EngineScheduler", now: float) -> "ScheduledBatch | None":
        raise NotImplementedError

    def default_prefill_max_requests(self, max_batch_size: int) -> int:
        """Prompts per prefill batch when the config does not say."""
        return 1

    def first_decode(self, sched: "EngineScheduler", st: "ResidentStage", now: float) -> "ScheduledBatch | None":
        """Serve a first stage's decode queue: up to `max_batch_size` oldest ready requests."""
        return sched.try_first_decode(st, sched.max_batch_size, now)

    def first_prefill(self, sched: "EngineScheduler", st: "ResidentStage", now: float) -> "ScheduledBatch | None":
        """Serve a first stage's prefill queue (also used by the starvation promotion)."""
        return sched.try_first_prefill(st, now, sched.prefill_token_budget, sched.prefill_max_requests)


Attempt = Callable[[], "ScheduledBatch | None"]


def oldest_first(cands: list[tuple[tuple, int, Attempt]]) -> "ScheduledBatch | None":
    """Try (arrival key, tie, attempt) candidates in ascending arrival order; first success wins."""
    if not cands:
        return None
    best = min(cands)
    batch = best[2]()
    if batch is not None:
        return batch
    if len(cands) > 1:
        cands.remove(best)
        cands.sort()
        for _, _, attempt in cands:
            batch = attempt()
            if batch is not None:
                return batch
    return None


def head_key(q: "Queue") -> tuple:
    return q.items[0].key
