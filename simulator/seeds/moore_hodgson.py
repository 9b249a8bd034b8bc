"""Prism's GPU-local admission order (Prism §6.3, Alg. 2): Moore-Hodgson over TTFT deadlines.

Requests sorted by deadline a + s (arrival + TTFT SLO) are appended to the schedule while the
running sum of their prefill times e = prompt / chunked-prefill speed stays within each one's
deadline; when the newest misses, the longest job in the schedule is dropped. The result keeps
the most requests on time. Dropped requests are late whatever happens; the colocated cluster
serves them after the schedule (in deadline order) rather than never: no request is lost.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence, TypeVar

R = TypeVar("R")


def moore_hodgson(requests: Sequence[R], now: float, deadline: Callable[[R], float],
                  exec_time: Callable[[R], float]) -> tuple[list[R], list[R]]:
    """(schedule in dispatch order, dropped requests in deadline order)."""
    ordered = sorted(requests, key=deadline)  # stable: ties keep the given (arrival) order
    kept: list[tuple[float, int]] = []  # max-heap of (-exec time, -position)
    t = now
    dropped: set[int] = set()
    for i, r in enumerate(ordered):
        e = exec_time(r)
        heapq.heappush(kept, (-e, -i))
        t += e
        if t > deadline(r):
            neg_e, neg_i = heapq.heappop(kept)
            t += neg_e
            dropped.add(-neg_i)
    schedule = [r for i, r in enumerate(ordered) if i not in dropped]
    late = [r for i, r in enumerate(ordered) if i in dropped]
    return schedule, late
