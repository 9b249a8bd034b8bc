"""KV for a batch: fit its requests into the pool, evicting (swapping out) when allowed.

Place in the data flow: a mixin of `EngineScheduler` (engine/core/scheduler.py), split out so that
the swap planning lives in one file; the batch formers (engine/core/batch_forming.py) call `_fit`,
`schedule` calls `_swap_in_ahead`. The rules (all-or-nothing eviction, victims from the stage
with the largest KV occupancy, blocked before waiting-decode, newest first; swap-in ahead of
need while headroom stays free) are in engine/core/scheduler.py's docstring. The copies go on the
batch's `swap_out` / `swap_in` lists; engine/core/block_pool.py does the accounting.
"""

from __future__ import annotations

from paraflex.engine.core.queues import ResidentStage, _key
from paraflex.engine.core.request import BLOCKED, SWAPPED_BLOCKED, SWAPPED_DECODE, WAITING_DECODE, StageRequest
from paraflex.engine.core.scheduled import ScheduledBatch


class KVPlanning:
    """KV fitting and swap planning for `EngineScheduler` (uses its pool, requests and stats)."""

    # --- KV: fit a set of (request, target context) pairs, evicting if allowed ---------------
    @staticmethod
    def _blocks_needed(st: ResidentStage, req: StageRequest, target: int) -> int:
        """Device blocks `req` needs to cover `target` tokens (all of them if swapped out)."""
        alloc = req.alloc
        if alloc is None:
            return -(-target // st.tokens_per_block) * st.num_layers
        per_layer = -(-target // alloc.tokens_per_block)
        if not alloc.on_host:
            per_layer -= alloc.blocks_per_layer
        return per_layer * alloc.num_layers if per_layer > 0 else 0

    def _make_room(self, need: int, exclude: set[str], swap_out: list) -> bool:
        """Evict until `need` device blocks are free; all-or-nothing. Appends to swap_out."""
        pool = self.pool
        deficit = need - pool.num_free
        if deficit <= 0:
            return True
        host_free = pool.host_num_free
        occupancy = {st.key: pool.used_by(st.key) for st in self.stages}
        cands: dict[tuple[str, int], list[tuple[StageRequest, int]]] = {}
        for req in self._reqs.values():
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
            self.stats["swap_out_blocks"] += len(plan)
            self.stats["swap_outs"] += 1
            req.transition(SWAPPED_BLOCKED if req.state == BLOCKED else SWAPPED_DECODE)
            self._swapped.add(req)
        return True

    def _swap_in_ahead(self, batch: ScheduledBatch) -> None:
        """Space freed: bring swapped requests back, oldest first, while `headroom` stays free.

        The copies ride on `batch.swap_in` (the worker runs them before the batch). Stops at
        the first request that does not fit, so younger ones never overtake older ones.
        """
        pool = self.pool
        if pool.num_free <= self.headroom_blocks:
            return
        for req in sorted(self._swapped, key=_key):
            n = req.alloc.num_blocks
            if pool.num_free - n < self.headroom_blocks:
                break
            plan = pool.swap_in(req.req_id)
            batch.swap_in.extend(plan)
            self.stats["swap_in_blocks"] += len(plan)
            self.stats["swap_ins"] += 1
            req.transition(BLOCKED if req.state == SWAPPED_BLOCKED else WAITING_DECODE)
            self._swapped.discard(req)

    def _fit(self, st: ResidentStage, members: list[tuple[StageRequest, int]], allow_evict: bool,
             swap_out: list, swap_in: list) -> bool:
        """Give every (request, target context) KV; swap in swapped members. False: nothing changed."""
        pool = self.pool
        need = 0
        blocks_needed = self._blocks_needed
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
                self.stats["swap_in_blocks"] += len(plan)
                self.stats["swap_ins"] += 1
                req.transition(WAITING_DECODE)
                self._swapped.discard(req)
            pool.grow(alloc, target)
        return True
