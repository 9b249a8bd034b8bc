"""A later stage's batches: received whole from upstream, queued by kind, run as formed.

Place in the data flow: one `LaterStageBatches` per `EngineScheduler` (engine/core/scheduler.py).
`receive` turns a `BatchMessage` from the previous stage into a `PendingBatch` in one of the
stage's queues (full decode batches, under-sized decode batches, prefill batches); the
policies (engine/core/policies/) call `run_oldest` through `Policy.attempt` when the scheduler
serves one of those queues: the oldest batch runs whole once its KV fits (`KVPlanner.fit`, which
may evict), so every later stage runs the batches the first stage formed
(engine/core/first_stage_batches.py), members aborted meanwhile dropped.
"""

from __future__ import annotations

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.kv_planner import KVPlanner
from paraflex.engine.core.messages import DECODE, PREFILL, BatchMessage
from paraflex.engine.core.queue_order import Queue, QueueOrder
from paraflex.engine.core.queues import PendingBatch, ResidentStage
from paraflex.engine.core.request import BLOCKED, RUNNING, SWAPPED_DECODE, WAITING_DECODE, WAITING_PREFILL, StageRequest
from paraflex.engine.core.request_table import RequestTable
from paraflex.engine.core.scheduled import BatchNeverFits, ProtocolError, ScheduledBatch, ScheduledRequest


class LaterStageBatches:
    """Received batches of later stages. `chunk_keys`: request id -> the key of the batch holding
    its latest prompt chunk here (a later chunk never sorts ahead of it)."""

    def __init__(self, pool: BlockPool, kv: KVPlanner, order: QueueOrder, requests: RequestTable, max_batch_size: int,
                 engine_id: int):
        self.pool = pool
        self.kv = kv
        self.order = order
        self.requests = requests
        self.max_batch_size = max_batch_size
        self.engine_id = engine_id
        self.chunk_keys: dict[str, tuple] = {}

    def receive(self, st: ResidentStage, msg: BatchMessage) -> bool:
        """Queue `msg` (for later stage `st`) as one batch; False when none of its requests is
        live here any more (nothing will run: drop its tensors)."""
        requests = self.requests
        live, gone = requests.live, requests.gone
        pb = PendingBatch(msg, requests.next_seq())
        row = 0
        floor = None  # key of the latest batch holding an earlier chunk of one of our prompts
        for e in msg.prefills:
            if e.req_id in gone:  # ended here already: its rows are not run
                row += e.num_tokens
                pb.dropped = True
                continue
            req = live.get(e.req_id)
            if req is None:
                req = requests.open(e.req_id, st, e.arrival, e.prompt_len, e.max_new_tokens, e.sampling, None)
            elif req.state == BLOCKED:
                req.transition(WAITING_PREFILL)
            elif req.state not in (WAITING_PREFILL, RUNNING):  # RUNNING: its previous chunk runs now
                raise ProtocolError(f"prefill chunk for {e.req_id!r} at {st.model}/{st.stage} in state {req.state}")
            if req.pending_chunks or req.state == RUNNING:  # an earlier chunk waits or runs here
                prev = self.chunk_keys.get(e.req_id)
                if prev is not None and (floor is None or prev > floor):
                    floor = prev
            req.pending_chunks += 1
            pb.prefills.append((req, e))
            pb.rows.append((row, row + e.num_tokens))
            row += e.num_tokens
        for e in msg.decodes:
            if e.req_id in gone:
                row += 1
                pb.dropped = True
                continue
            req = live.get(e.req_id)
            if req is None:
                raise ProtocolError(f"decode step for unknown request {e.req_id!r} at {st.model}/{st.stage}; its prefill never arrived")
            if req.context_len != e.position:
                raise ProtocolError(f"decode step for {e.req_id!r} at position {e.position}, but {req.context_len} tokens have KV here")
            req.transition(WAITING_DECODE if req.state == BLOCKED else SWAPPED_DECODE)
            pb.decodes.append((req, e))
            pb.rows.append((row, row + 1))
            row += 1
        if not len(pb):
            return False
        pb.key = (min(r.arrival for r in pb.members()), pb.seq)
        # A later chunk must never sort ahead of the batch with the chunk before it (its head
        # would wait for that chunk, which waits behind it: a stall under chunked prefill).
        if floor is not None and floor[0] > pb.key[0]:
            pb.key = (floor[0], pb.seq)
        for req, _ in pb.prefills:
            self.chunk_keys[req.req_id] = pb.key
        pb.queue = self._queue_for(st, pb)
        pb.queue.push(pb, self.order.decisions)
        return True

    def _queue_for(self, st: ResidentStage, pb: PendingBatch) -> Queue:
        if pb.msg.kind == PREFILL:
            return st.prefill_q
        if pb.msg.kind == DECODE and len(pb) >= self.max_batch_size:
            return st.full_q
        return st.decode_q

    def run_oldest(self, st: ResidentStage, q: Queue, now: float) -> ScheduledBatch | None:
        """Run the oldest received batch of queue `q` whole, if its KV fits."""
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
        if not self.kv.fit(st, members, True, swap_out, swap_in):
            return None
        q.pop_front(1)
        q.touch(self.order.decisions)
        reqs = []
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
                              self.pool.block_bytes, swap_out, swap_in, msg, list(pb.rows) if pb.dropped else None, now)

    def drop(self, st: ResidentStage, req: StageRequest) -> None:
        """Remove a cancelled request from every received batch that holds it (rare: a scan)."""
        for q in st.queues():
            for pb in list(q.items):
                for lst, base in ((pb.prefills, 0), (pb.decodes, len(pb.prefills))):
                    for i in range(len(lst) - 1, -1, -1):
                        if lst[i][0] is req:
                            del lst[i]
                            del pb.rows[base + i]
                            pb.dropped = True
                if not len(pb):
                    q.remove(pb)

    def forget(self, req_id: str) -> None:
        """`req_id` ended here."""
        self.chunk_keys.pop(req_id, None)
