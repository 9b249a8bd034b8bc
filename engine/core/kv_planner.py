"""KV for a batch: fit its requests into the pool, evicting (swapping out) when allowed.

Place in the data flow: one `KVPlanner` per `EngineScheduler` (engine/core/scheduler.py), over
the engine's `BlockPool` (engine/core/block_pool.py does the accounting) and its live requests.
The batch formers (engine/core/first_stage_batches.py, engine/core/later_stage_batches.py) call
`fit` and `admission_reserve`; `schedule` calls `swap_in_ahead`. It owns the set of swapped-out
requests and the swap counters; the copies go on the batch's `swap_out` / `swap_in` lists.

KV and swapping (§5 "Swapping policy", §6.2)
--------------------------------------------
A batch takes KV for its new tokens before it runs. A new prompt is admitted at the first stage
only into free blocks, keeping a watermark (1% of the pool) plus the blocks of every swapped-out
request free, so admissions never cause swapping nor take the room swapped requests need to
come back (back-pressure). Work already admitted (decode steps, later-stage batches) evicts when
it does not fit: victims come from the resident stage with the largest device KV occupancy on
this engine (re-ranked after each victim), blocked before waiting-decode, newest first; running,
mid-prompt and same-batch requests are never victims; nothing is ever recomputed. Eviction is
all-or-nothing: if the batch would not fit even after every possible victim (or the host pool is
full) nothing moves and the batch waits. A first-stage decode batch that cannot fit shrinks
(newest members out); a later-stage batch runs whole or waits. Swap-in: a swapped request in a
batch is swapped back when the batch is formed (first-stage decode batches take ready requests
in arrival order, swapped or not); and whenever a decision evicted nothing, swapped requests
come back ahead of need, oldest first, while 10% of the pool (at least the watermark) stays
free. These copies ride on the returned batch's `swap_in` list. Sizing requirement: each
stage's pool must hold one full batch of maximum-length requests by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.queues import ResidentStage, arrival_key
from paraflex.engine.core.request import BLOCKED, SWAPPED_BLOCKED, SWAPPED_DECODE, WAITING_DECODE, StageRequest
from paraflex.engine.core.scheduled import ScheduledBatch
from paraflex.errors import UserError


def blocks_needed(st: ResidentStage, req: StageRequest, target: int) -> int:
    """Device blocks `req` needs to cover `target` tokens at `st` (all of them if swapped out)."""
    alloc = req.alloc
    if alloc is None:
        return -(-target // st.tokens_per_block) * st.num_layers
    per_layer = -(-target // alloc.tokens_per_block)
    if not alloc.on_host:
        per_layer -= alloc.blocks_per_layer
    return per_layer * alloc.num_layers if per_layer > 0 else 0


class KVPlanner:
    """KV fitting and swap planning over one engine's pool. `live` returns the engine's live
    requests (eviction candidates); `stages` is the engine's list of resident stages."""

    def __init__(self, pool: BlockPool, live: Callable[[], Iterable[StageRequest]], stages: list[ResidentStage],
                 watermark: float):
        self.pool = pool
        self.live = live
        self.stages = stages
        self.watermark_blocks = int(watermark * pool.capacity + 0.999999) if watermark else 0
        # free blocks kept when swapping in ahead of need, so the swap-in does not force an eviction
        self.headroom_blocks = max(self.watermark_blocks, pool.capacity // 10)
        self.swapped: set[StageRequest] = set()  # requests whose KV is in the host pool
        self.swap_out_blocks = self.swap_in_blocks = self.swap_outs = self.swap_ins = 0

    def admission_reserve(self) -> int:
        """Free blocks a new prompt (or chunk) must leave: the watermark plus the blocks of every
        swapped-out request, so admissions never cause swapping nor take their room."""
        return self.watermark_blocks + self.pool.host_num_used

    def token_limits(self) -> dict[str, tuple[int, int]]:
        """Per resident model: (prompt tokens a first stage admits into an otherwise empty pool,
        above the watermark; tokens of its whole context, prompt + max_tokens - 1)."""
        capacity = self.pool.capacity
        out = {}
        for st in self.stages:
            per_layer = capacity // st.num_layers
            prompt = (capacity - self.watermark_blocks) // st.num_layers if st.is_first else per_layer
            out[st.model] = (prompt * st.tokens_per_block, per_layer * st.tokens_per_block)
        return out

    def check_fits_ever(self, req_id: str, st: ResidentStage, prompt_len: int, max_new: int, engine_id: int) -> None:
        """Refuse (UserError) a new request at first stage `st` whose prompt + max_tokens can
        never fit this engine's pool."""
        longest = prompt_len + max_new - 1  # the last token is never fed back
        blocks = -(-longest // st.tokens_per_block) * st.num_layers
        if blocks > self.pool.capacity:
            raise UserError(
                f"request {req_id!r}: {prompt_len} prompt tokens + max_tokens {max_new} need {blocks} KV blocks "
                f"at {st.model} stage 0, but engine {engine_id} holds {self.pool.capacity}; shorten the prompt or lower max_tokens "
                f"(or give the engine more KV memory: cluster.memory_gb, or fewer stages per engine)"
            )

    def swap_totals(self) -> dict[str, int]:
        """Swaps on this engine so far: requests swapped out and in, and the bytes each way
        (whole blocks of the pool's `block_bytes`, as the worker copies them)."""
        block_bytes = self.pool.block_bytes
        return {"swap_outs": self.swap_outs, "swap_ins": self.swap_ins,
                "swap_out_bytes": self.swap_out_blocks * block_bytes, "swap_in_bytes": self.swap_in_blocks * block_bytes}

    def swapped_ids(self) -> dict[str, list[str]]:
        """Model -> ids of the requests whose KV on this engine is in the host pool now."""
        out: dict[str, list[str]] = {}
        for req in list(self.swapped):  # one atomic copy: /metrics may read from another thread
            out.setdefault(req.model, []).append(req.req_id)
        return out

    def forget(self, req: StageRequest) -> None:
        """`req` ended (its KV released): no longer swapped."""
        self.swapped.discard(req)

    # --- fit a set of (request, target context) pairs, evicting if allowed -------------------
    def fit(self, st: ResidentStage, members: list[tuple[StageRequest, int]], allow_evict: bool,
            swap_out: list, swap_in: list) -> bool:
        """Give every (request, target context) KV; swap in swapped members. False: nothing changed."""
        pool = self.pool
        need = 0
        for req, target in members:
            need += blocks_needed(st, req, target)
        if need > pool.num_free:
            if not allow_evict or need > pool.capacity:
                return False
            if not self._make_room(need, {r.req_id for r, _ in members}, swap_out):
                return False
        for req, target in members:
            alloc = req.alloc
            if alloc is None:
                alloc = req.alloc = pool.open(req.req_id, st.key, st.num_layers, st.tokens_per_block)
            elif alloc.on_host:
                plan = pool.swap_in(req.req_id)
                swap_in.extend(plan)
                self.swap_in_blocks += len(plan)
                self.swap_ins += 1
                req.transition(WAITING_DECODE)
                self.swapped.discard(req)
            pool.grow(alloc, target)
        return True

    def _make_room(self, need: int, exclude: set[str], swap_out: list) -> bool:
        """Evict until `need` device blocks are free; all-or-nothing. Appends to swap_out."""
        pool = self.pool
        deficit = need - pool.num_free
        if deficit <= 0:
            return True
        host_free = pool.host_num_free
        occupancy = {st.key: pool.used_by(st.key) for st in self.stages}
        cands: dict[tuple[str, int], list[tuple[StageRequest, int]]] = {}
        for req in self.live():
            if req.state not in (BLOCKED, WAITING_DECODE) or req.req_id in exclude or req.prefilled < req.prompt_len:
                continue  # running, prefilling (a chunked prompt between chunks too) or in this batch
            alloc = req.alloc
            if alloc is None or alloc.on_host or not alloc.num_blocks:
                continue
            cands.setdefault((req.model, req.stage), []).append((req, alloc.num_blocks))
        # within a stage: blocked before waiting-decode, newest first -> pop from the end
        for lst in cands.values():
            lst.sort(key=lambda c: (c[0].state == BLOCKED, c[0].key))
        victims = []
        while deficit > 0 and cands:
            key = max(cands, key=lambda k: (occupancy[k], k))
            lst = cands[key]
            req, n = lst.pop()
            if not lst:
                del cands[key]
            if n > host_free:
                continue
            victims.append(req)
            deficit -= n
            host_free -= n
            occupancy[key] -= n
        if deficit > 0:
            return False
        for req in victims:
            plan = pool.swap_out(req.req_id)
            swap_out.extend(plan)
            self.swap_out_blocks += len(plan)
            self.swap_outs += 1
            req.transition(SWAPPED_BLOCKED if req.state == BLOCKED else SWAPPED_DECODE)
            self.swapped.add(req)
        return True

    def swap_in_ahead(self, batch: ScheduledBatch) -> None:
        """Space freed: bring swapped requests back, oldest first, while `headroom` stays free.

        The copies ride on `batch.swap_in` (the worker runs them before the batch). Stops at
        the first request that does not fit, so younger ones never overtake older ones.
        """
        pool = self.pool
        if pool.num_free <= self.headroom_blocks:
            return
        for req in sorted(self.swapped, key=arrival_key):
            n = req.alloc.num_blocks
            if pool.num_free - n < self.headroom_blocks:
                break
            plan = pool.swap_in(req.req_id)
            batch.swap_in.extend(plan)
            self.swap_in_blocks += len(plan)
            self.swap_ins += 1
            req.transition(BLOCKED if req.state == SWAPPED_BLOCKED else WAITING_DECODE)
            self.swapped.discard(req)
