"""Forming batches: a first stage's decode, prefill and chunked batches; a later stage's
received batch.

Place in the data flow: a mixin of `EngineScheduler` (engine/core/scheduler.py), split out so that
batch formation lives in one file; the policies (engine/policies/) call these formers through
`Policy.attempt`. Each takes KV through `_fit` (engine/core/kv_planning.py), moves its requests to
running and returns a `ScheduledBatch` with the message for the next stage.
"""

from __future__ import annotations

from paraflex.engine.core.messages import DECODE, MIXED, PREFILL, BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.core.queues import Queue, ResidentStage
from paraflex.engine.core.request import RUNNING, WAITING_PREFILL, StageRequest
from paraflex.engine.core.scheduled import BatchNeverFits, ScheduledBatch, ScheduledRequest


class BatchForming:
    """Batch formers for `EngineScheduler` (uses its queues, pool and batch ids)."""

    # --- batch formers (policies call these) ------------------------------------------------
    def try_first_decode(self, st: ResidentStage, limit: int, now: float,
                         prefill_budget: int = 0) -> ScheduledBatch | None:
        """First stage: a decode batch of the oldest ready requests, shrunk until KV fits.

        With `prefill_budget` > 0 (Sarathi) prompt chunks fill the rest of the token budget.
        """
        q = st.decode_q
        take = q.items[:limit]
        swap_out: list = []
        swap_in: list = []
        while take:
            if self._fit(st, [(r, r.context_len + 1) for r in take], True, swap_out, swap_in):
                break
            take.pop()
        chunks = self._take_chunks(st, prefill_budget - len(take), swap_out, swap_in) if prefill_budget > 0 else []
        if not take and not chunks:
            return None
        if take:
            q.pop_front(len(take))
            q.touch(self.decisions)
        return self._form_first(st, chunks, take, now, swap_out, swap_in)

    def try_first_prefill(self, st: ResidentStage, now: float, budget: int, max_requests: int) -> ScheduledBatch | None:
        """First stage: admit the oldest waiting prompts (whole) under the budget, into free KV."""
        q = st.prefill_q
        if not q.items:
            return None
        chosen: list[StageRequest] = []
        tokens = 0
        need = self.watermark_blocks + self.pool.host_num_used  # swapped requests keep their room
        for req in q.items:
            if len(chosen) >= max_requests or (chosen and tokens + req.prompt_len > budget):
                break
            n = self._blocks_needed(st, req, req.prompt_len)
            if need + n > self.pool.num_free:
                break
            chosen.append(req)
            tokens += req.prompt_len
            need += n
        if not chosen:
            return None
        swap_out: list = []
        swap_in: list = []
        ok = self._fit(st, [(r, r.prompt_len) for r in chosen], False, swap_out, swap_in)
        assert ok, "prefill admission checked free blocks"
        q.pop_front(len(chosen))
        q.touch(self.decisions)
        return self._form_first(st, [(r, r.prefilled, r.prompt_len - r.prefilled) for r in chosen], [], now, swap_out, swap_in)

    def _take_chunks(self, st: ResidentStage, budget: int, swap_out: list, swap_in: list) -> list:
        """Sarathi: prompt chunks of the oldest waiting prompts filling `budget` tokens."""
        q = st.prefill_q
        if budget <= 0 or not q.items:
            return []
        chunks = []
        for req in list(q.items):
            if budget <= 0:
                break
            n = min(budget, req.prompt_len - req.prefilled)
            target = req.prefilled + n
            if self._blocks_needed(st, req, target) + self.watermark_blocks + self.pool.host_num_used > self.pool.num_free:
                break
            self._fit(st, [(req, target)], False, swap_out, swap_in)
            q.remove(req)
            chunks.append((req, req.prefilled, n))
            budget -= n
        if chunks:
            q.touch(self.decisions)
        return chunks

    def _form_first(self, st: ResidentStage, chunks: list, decodes: list[StageRequest], now: float,
                    swap_out: list, swap_in: list) -> ScheduledBatch:
        batch_id = self._next_batch_id(st)
        kind = MIXED if chunks and decodes else (PREFILL if chunks else DECODE)
        reqs = []
        pentries = []
        dentries = []
        pool = self.pool
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
                              pool.block_bytes, swap_out, swap_in, msg, None, now)

    def try_pending(self, st: ResidentStage, q: Queue, now: float) -> ScheduledBatch | None:
        """Later stage: run the oldest received batch of queue `q` whole, if its KV fits."""
        if not q.items:
            return None
        pb = q.items[0]
        for req, e in pb.prefills:
            if req.state != WAITING_PREFILL or req.prefilled != e.start:
                return None  # an earlier chunk of this request has not run here yet
        members = [(r, e.start + e.num_tokens) for r, e in pb.prefills] + [(r, e.position + 1) for r, e in pb.decodes]
        whole = sum(-(-t // st.tokens_per_block) for _, t in members) * st.num_layers
        if whole > self.pool.capacity:
            raise BatchNeverFits(
                f"engine {self.engine_id}: batch {pb.msg.batch_id} of {st.model} stage {st.stage} needs {whole} KV blocks, "
                f"the pool holds {self.pool.capacity}; give this engine KV for max_batch_size requests of full context "
                "(cluster.memory_gb), or lower scheduler.max_batch_size or prefill_token_budget",
                st.model, [r.req_id for r, _ in members])
        swap_out: list = []
        swap_in: list = []
        if not self._fit(st, members, True, swap_out, swap_in):
            return None
        q.pop_front(1)
        q.touch(self.decisions)
        reqs = []
        pool = self.pool
        for req, e in pb.prefills:
            req.transition(RUNNING)
            end = e.start + e.num_tokens
            reqs.append(ScheduledRequest(req.req_id, PREFILL, e.start, e.num_tokens, end, req.alloc.table,
                                         None, st.is_last and end == req.prompt_len, req.sampling))
        for req, e in pb.decodes:
            req.transition(RUNNING)
            reqs.append(ScheduledRequest(req.req_id, DECODE, e.position, 1, e.position + 1, req.alloc.table,
                                         None, st.is_last, req.sampling))
        msg = None
        src = pb.msg
        if not st.is_last:
            msg = BatchMessage(src.model, st.stage + 1, src.batch_id, src.kind, [e for _, e in pb.prefills],
                               [e for _, e in pb.decodes], src.formed_at)
        return ScheduledBatch(src.batch_id, st.model, st.stage, src.kind, reqs, st.num_layers, False, st.is_last,
                              pool.block_bytes, swap_out, swap_in, msg, list(pb.rows) if pb.dropped else None, now)
