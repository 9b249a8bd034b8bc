"""Aegaeon's prefill scheduling (SOSP'25 §4.2, Alg. 1): grouped FCFS over prefill instances.

Each prefill instance keeps a queue of groups; a group holds requests of one model, at most
MAX_GPSIZE = 8 over its lifetime (its size is cumulative: executing a request does not free a
place, so FCFS is not bent far). A new request joins the first group of its model with room,
scanning instances in order; otherwise it opens a group at the back of the least-loaded
instance's queue, the load being the estimated time to run every pending group there, switches
included. Instances run one request at a time from their front group.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

MAX_GPSIZE = 8


class Group:
    __slots__ = ("model", "size", "pending")

    def __init__(self, model: str):
        self.model = model
        self.size = 0  # cumulative
        self.pending: deque = deque()


class GroupedFCFS:
    """The job queues of the prefill instances. `exec_time(request)` and `switch_time(model)`
    estimate the load (Appendix A.2 there: the cost model and Eq. 4)."""

    def __init__(self, num_instances: int, exec_time: Callable, switch_time: Callable[[str], float],
                 max_group: int = MAX_GPSIZE):
        self.queues: list[deque[Group]] = [deque() for _ in range(num_instances)]
        self.exec_time = exec_time
        self.switch_time = switch_time
        self.max_group = max_group

    def load(self, i: int, active: str | None) -> float:
        prev, total = active, 0.0
        for g in self.queues[i]:
            if g.model != prev:
                total += self.switch_time(g.model)
                prev = g.model
            total += sum(self.exec_time(r) for r in g.pending)
        return total

    def dispatch(self, request, model: str, active: list[str | None]) -> tuple[int, bool]:
        """Queue `request`; return (instance, joined an existing group)."""
        for i, q in enumerate(self.queues):
            for g in q:
                if g.model == model and g.size < self.max_group:
                    g.size += 1
                    g.pending.append(request)
                    return i, True
        best = min(range(len(self.queues)), key=lambda i: (self.load(i, active[i]), i))
        g = Group(model)
        g.size = 1
        g.pending.append(request)
        self.queues[best].append(g)
        return best, False

    def next_request(self, i: int):
        """(model, request) to run next on instance i, or None; drops exhausted groups."""
        q = self.queues[i]
        while q and not q[0].pending:
            q.popleft()
        if not q:
            return None
        g = q[0]
        r = g.pending.popleft()
        if not g.pending:
            q.popleft()
        return g.model, r

    def next_model_after(self, i: int, model: str) -> str | None:
        """The first model other than `model` queued on instance i (what to prefetch)."""
        for g in self.queues[i]:
            if g.model != model:
                return g.model
        return None
