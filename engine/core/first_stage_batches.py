"""Forming batches at a model's first stage: decode batches, prompt batches, prompt chunks.

Place in the data flow: one `FirstStageBatches` per `EngineScheduler` (engine/core/scheduler.py);
the policies (engine/core/policies/) call `decode` and `prefill` through `Policy.attempt` when
the scheduler serves a first stage's queue. Each takes KV through the `KVPlanner`
(engine/core/kv_planner.py), moves its requests to running, marks the queue served at the
current decision (`QueueOrder.decisions`) and returns a `ScheduledBatch` whose message the
later stages run as it is (engine/core/later_stage_batches.py). It names the batches it forms.
"""

from __future__ import annotations

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.kv_planner import KVPlanner, blocks_needed
from paraflex.engine.core.messages import DECODE, MIXED, PREFILL, BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.core.queue_order import QueueOrder
from paraflex.engine.core.queues import ResidentStage
from paraflex.engine.core.request import RUNNING, StageRequest
from paraflex.engine.core.scheduled import ScheduledBatch, ScheduledRequest


class FirstStageBatches:
    """Batch formers of first stages; `batch_seq` counts the batches formed (their ids)."""

    def __init__(self, pool: BlockPool, kv: KVPlanner, order: QueueOrder, engine_id: int):
        self.pool = pool
        self.kv = kv
        self.order = order
        self.engine_id = engine_id
        self.batch_seq = 0

    def decode(self, st: ResidentStage, limit: int, now: float, prefill_budget: int = 0) -> ScheduledBatch | None:
        """A decode batch of the oldest ready requests (up to `limit`), shrunk until KV fits.

        With `prefill_budget` > 0 (Sarathi) prompt chunks fill the rest of the token budget.
        """
        q = st.decode_q
        take = q.items[:limit]
        swap_out: list = []
        swap_in: list = []
        fit = self.kv.fit
        while take:
            if fit(st, [(r, r.context_len + 1) for r in take], True, swap_out, swap_in):
                break
            take.pop()
        chunks = self._take_chunks(st, prefill_budget - len(take), swap_out, swap_in) if prefill_budget > 0 else []
        if not take and not chunks:
            return None
        if take:
            q.pop_front(len(take))
            q.touch(self.order.decisions)
        return self._form(st, chunks, take, now, swap_out, swap_in)

    def prefill(self, st: ResidentStage, now: float, budget: int, max_requests: int) -> ScheduledBatch | None:
        """Admit the oldest waiting prompts (whole) under the budget, into free KV."""
        q = st.prefill_q
        if not q.items:
            return None
        chosen: list[StageRequest] = []
        tokens = 0
        need = self.kv.admission_reserve()
        num_free = self.pool.num_free
        for req in q.items:
            if len(chosen) >= max_requests or (chosen and tokens + req.prompt_len > budget):
                break
            n = blocks_needed(st, req, req.prompt_len)
            if need + n > num_free:
                break
            chosen.append(req)
            tokens += req.prompt_len
            need += n
        if not chosen:
            return None
        swap_out: list = []
        swap_in: list = []
        ok = self.kv.fit(st, [(r, r.prompt_len) for r in chosen], False, swap_out, swap_in)
        assert ok, "prefill admission checked free blocks"
        q.pop_front(len(chosen))
        q.touch(self.order.decisions)
        return self._form(st, [(r, r.prefilled, r.prompt_len - r.prefilled) for r in chosen], [], now, swap_out, swap_in)

    def _take_chunks(self, st: ResidentStage, budget: int, swap_out: list, swap_in: list) -> list:
        """Sarathi: prompt chunks of the oldest waiting prompts filling `budget` tokens."""
        q = st.prefill_q
        if budget <= 0 or not q.items:
            return []
        chunks = []
        pool, kv = self.pool, self.kv
        for req in list(q.items):
            if budget <= 0:
                break
            n = min(budget, req.prompt_len - req.prefilled)
            target = req.prefilled + n
            if blocks_needed(st, req, target) + kv.admission_reserve() > pool.num_free:
                break
            kv.fit(st, [(req, target)], False, swap_out, swap_in)
            q.remove(req)
            chunks.append((req, req.prefilled, n))
            budget -= n
        if chunks:
            q.touch(self.order.decisions)
        return chunks

    def _form(self, st: ResidentStage, chunks: list, decodes: list[StageRequest], now: float,
              swap_out: list, swap_in: list) -> ScheduledBatch:
        batch_id = self.next_batch_id(st)
        kind = MIXED if chunks and decodes else (PREFILL if chunks else DECODE)
        reqs = []
        pentries = []
        dentries = []
        for req, start, n in chunks:
            req.transition(RUNNING)
            end = start + n
            toks = req.token_ids[start:end] if req.token_ids is not None else None
            reqs.append(ScheduledRequest(req.req_id, PREFILL, start, n, end, req.alloc.table, toks,
                                         st.is_last and end == req.prompt_len, req.sampling))
            pentries.append(PrefillEntry(req.req_id, start, n, req.prompt_len, req.max_new_tokens, req.arrival,
                                         req.token_ids[: req.prompt_len] if start == 0 and req.token_ids is not None else None,
                                         req.sampling if start == 0 else None))
        for req in decodes:
            req.transition(RUNNING)
            pos = req.context_len
            tok = req.token_ids[-1] if req.token_ids is not None else None
            reqs.append(ScheduledRequest(req.req_id, DECODE, pos, 1, pos + 1, req.alloc.table,
                                         [tok] if tok is not None else None, st.is_last, req.sampling))
            dentries.append(DecodeEntry(req.req_id, tok, pos))
        msg = None if st.is_last else BatchMessage(st.model, st.stage + 1, batch_id, kind, pentries, dentries, now)
        return ScheduledBatch(batch_id, st.model, st.stage, kind, reqs, st.num_layers, True, st.is_last,
                              self.pool.block_bytes, swap_out, swap_in, msg, None, now)

    def next_batch_id(self, st: ResidentStage) -> str:
        self.batch_seq += 1
        return f"{st.model}/e{self.engine_id}/{self.batch_seq}"
