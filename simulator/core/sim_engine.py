"""One simulated execution engine: the engine core's scheduler and KV pool, plus time.

cluster.py owns one `SimEngine` per engine of the placement. The scheduling decisions, the
request states and the KV block accounting are the engine core's own objects
(`paraflex.engine.core.scheduler`, `paraflex.engine.core.block_pool`), unchanged; this module only says
how long things take: a stage execution from the cost model (TP all-reduce included, it is
part of `CostModel`'s per-layer time), a swap from the host link's bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraflex.engine.core.messages import DECODE


@dataclass
class StageInfo:
    """A resident stage of one model replica on one engine, and where its pipeline goes."""

    model: str
    arch: object
    replica: int
    stage: int
    num_layers: int
    first: bool
    last: bool
    next_engine: int  # -1 on the last stage
    first_engine: int


def mixed_time(c, a, num_layers: int, first: bool, last: bool, prefill_tokens: int, num_seqs: int,
               batch_size: int, total_context: int) -> float:
    """Time of a batch of prompt chunks (`prefill_tokens` over `num_seqs` requests) and
    `batch_size` decodes (`total_context` tokens) through `num_layers` layers of `a` on cost
    model `c`: one pass through the weights, so linear layers and TP communication run once
    over all rows (Sarathi batches here, the seed systems' whole-model steps in seeds/)."""
    rows = prefill_tokens + batch_size
    per_layer = (c.linear_time(a, rows) + c.attention_prefill_time(a, prefill_tokens, num_seqs)
                 + c.attention_decode_time(a, batch_size, total_context) + c.tp_comm_time(a, rows))
    t = num_layers * per_layer
    if first:
        t += c.embedding_time(a, rows)
    if last:
        t += c.head_time(a, num_seqs + batch_size)
    return t


class SimEngine:
    """Timing wrapper around one engine's scheduler. `busy` while a stage executes; `pending`
    holds the times of the events on the heap addressed to it (stage ends, batch and token
    arrivals), for the decode fast-forward's horizon; `running` is the `StageEndEvent` (or `ReplayEndEvent`) of the
    stage it executes (the joint replay takes such a stage over)."""

    __slots__ = ("id", "scheduler", "pool", "cost", "stages", "busy", "wake_pending", "pending", "running", "swap_Bps",
                 "block_bytes", "_decode_cache", "_prefill_cache")

    def __init__(self, engine_id: int, scheduler, pool, cost, stages: dict[str, StageInfo], swap_Bps: float):
        self.id = engine_id
        self.scheduler = scheduler
        self.pool = pool
        self.cost = cost
        self.stages = stages
        self.busy = False
        self.wake_pending = False
        self.pending: list[float] = []
        self.running = None
        self.swap_Bps = swap_Bps
        self.block_bytes = pool.block_bytes
        self._decode_cache: dict = {}
        self._prefill_cache: dict = {}

    def swap_time(self, blocks: int) -> float:
        return blocks * self.block_bytes / self.swap_Bps if blocks else 0.0

    def prefill_time(self, info: StageInfo, num_tokens: int, num_seqs: int) -> float:
        key = (info.model, num_tokens, num_seqs)
        t = self._prefill_cache.get(key)
        if t is None:
            t = self.cost.prefill_time(info.arch, info.num_layers, num_tokens, first=info.first, last=info.last, num_seqs=num_seqs)
            self._prefill_cache[key] = t
        return t

    def decode_time(self, info: StageInfo, batch_size: int, total_context: int) -> float:
        """CostModel.decode_time, computed as (everything but attention, cached per batch
        size) + layers x attention(context): the same sum, without redoing the linear part
        for every context length (tests check equality with the cost model)."""
        return self.decode_time_fn(info, batch_size)(total_context)

    def decode_time_fn(self, info: StageInfo, batch_size: int):
        """`decode_time(info, batch_size, ctx)` as a function of ctx alone, built once per
        (model, batch size): the step-by-step path and the fast-forward's replay loop both
        evaluate it, so their times are the same floats."""
        key = (info.model, batch_size)
        fn = self._decode_cache.get(key)
        if fn is None:
            arch, layers, cost = info.arch, info.num_layers, self.cost
            full = cost.decode_time(arch, layers, batch_size, batch_size, first=info.first, last=info.last)
            rest = full - layers * cost.attention_decode_time(arch, batch_size, batch_size)
            fn = self._decode_cache[key] = cost.attention_decode_fn(arch, batch_size, rest, layers)
        return fn

    def mixed_time(self, info: StageInfo, prefill_tokens: int, num_seqs: int, batch_size: int, total_context: int) -> float:
        """A Sarathi batch: prompt chunks and decodes share one pass through the weights, so
        the linear layers and TP communication run once over all rows."""
        return mixed_time(self.cost, info.arch, info.num_layers, info.first, info.last, prefill_tokens, num_seqs,
                          batch_size, total_context)

    def batch_time(self, info: StageInfo, batch) -> tuple[float, int, int]:
        """(execution time, decode requests, new tokens) of one `ScheduledBatch` at this stage:
        prompt chunks and/or decode steps, counted in one pass over its requests."""
        prefill_tokens = seqs = decodes = ctx = 0
        for r in batch.requests:
            if r.kind == DECODE:
                decodes += 1
                ctx += r.context_len
            else:
                prefill_tokens += r.num_tokens
                seqs += 1
        if not decodes:
            t = self.prefill_time(info, prefill_tokens, seqs)
        elif not prefill_tokens:
            t = self.decode_time(info, decodes, ctx)
        else:
            t = self.mixed_time(info, prefill_tokens, seqs, decodes, ctx)
        return t, decodes, prefill_tokens + decodes
