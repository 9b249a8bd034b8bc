"""Aegaeon's decode instances (SOSP'25 §4.3, Alg. 2): work lists of same-model batches run in
rounds of weighted round-robin turns.

A newly prefilled request joins the first batch of its model (instances in order) whose KV
still fits beside that model's weights on the GPU; otherwise it opens a batch on the instance
with the shortest work list. At each round start the list is reordered so batches of one model
are adjacent (a model needs two batches only when one batch's KV outgrows the GPU:
`split_overflow`), and every batch gets its quota from `wrr_quota.py`. The cluster
(aegaeon_cluster.py) runs the turns.
"""

from __future__ import annotations

from typing import Callable

from paraflex.simulator.seeds.wrr_quota import Q_MAX_S, wrr_quotas


class DecodeBatch:
    __slots__ = ("model", "arch", "requests")

    def __init__(self, model: str, arch):
        self.model = model
        self.arch = arch
        self.requests: list = []

    def kv_bytes(self) -> int:
        return sum(r.kv_bytes() for r in self.requests)


class WorkList:
    """One decode instance's batches and its current round: (batch, quota) turns."""

    def __init__(self):
        self.batches: list[DecodeBatch] = []
        self.round: list[tuple[DecodeBatch, float]] = []
        self.turn = 0
        self.alpha = 0.0

    def start_round(self, step_time: Callable[[DecodeBatch], float], deadline: Callable[[str], float],
                    switch_time: Callable[[str], float], q_max: float = Q_MAX_S) -> None:
        self.batches = [b for b in self.batches if b.requests]
        order: list[str] = []
        for b in self.batches:
            if b.model not in order:
                order.append(b.model)
        self.batches.sort(key=lambda b: order.index(b.model))  # stable: same-model batches adjacent
        models = [b.model for b in self.batches]
        c = 0.0
        if len(order) > 1:
            c = sum(switch_time(m) for i, m in enumerate(models) if m != models[i - 1])
        self.alpha, quotas = wrr_quotas([deadline(m) for m in models], [step_time(b) for b in self.batches], c, q_max)
        self.round = list(zip(self.batches, quotas))
        self.turn = 0


def dispatch_decode(worklists: list[WorkList], request, arch, fits: Callable[[int, DecodeBatch, object], bool]) -> int:
    """Put `request` in a batch; return the instance. `fits(i, batch, request)` says whether the
    batch's KV plus the request's stays within instance i's KV room for that model."""
    for i, wl in enumerate(worklists):
        for b in wl.batches:
            if b.model == request.model and fits(i, b, request):
                b.requests.append(request)
                return i
    best = min(range(len(worklists)), key=lambda i: (len(worklists[i].batches), i))
    b = DecodeBatch(request.model, arch)
    b.requests.append(request)
    worklists[best].batches.append(b)
    return best


def split_overflow(wl: WorkList, batch: DecodeBatch, room_bytes: int) -> None:
    """Move the newest requests of `batch` into a new batch of the same model, right after it,
    until its KV (one more token each) fits in `room_bytes`; the new batch runs from next round."""
    moved: list = []
    while len(batch.requests) > 1 and sum(r.kv_bytes(r.context + 1) for r in batch.requests) > room_bytes:
        moved.insert(0, batch.requests.pop())
    if moved:
        nb = DecodeBatch(batch.model, batch.arch)
        nb.requests = moved
        wl.batches.insert(wl.batches.index(batch) + 1, nb)
