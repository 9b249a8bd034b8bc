"""Bulk decode advance: many rounds of the driving protocol for decode batches, in one call.

Place in the data flow: one `BulkAdvance` per `EngineScheduler` (engine/core/scheduler.py, its
`bulk`), used only by the simulator's fast path (simulator/fastpath/), which proves first that
the rounds run undisturbed and computes every decision itself; these calls then leave the
scheduler in exactly the state the rounds one by one leave (the same requests' states, queues
and ages, the same KV blocks allocated in the same order, the same counters). The decode
fast-forward uses `advance_first_decode` / `advance_later_decode`; the joint replay of a
pipeline with the one-stage replicas on its engines the `replay_*` calls, in the order its cut
applies them. tests/simulator/test_sim_fast_forward.py and test_sim_joint_replay.py pin this
against the step-by-step path.
"""

from __future__ import annotations

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.first_stage_batches import FirstStageBatches
from paraflex.engine.core.later_stage_batches import LaterStageBatches
from paraflex.engine.core.messages import DECODE
from paraflex.engine.core.queue_order import QueueOrder
from paraflex.engine.core.queues import ResidentStage, ResidentStages
from paraflex.engine.core.request import BLOCKED, FINISHED, RUNNING, WAITING_DECODE, StageRequest
from paraflex.engine.core.request_table import RequestTable
from paraflex.engine.core.scheduled import ProtocolError, ScheduledBatch


class BulkAdvance:
    """State moves of the simulator's fast path over one engine's scheduler parts."""

    def __init__(self, pool: BlockPool, requests: RequestTable, order: QueueOrder, first: FirstStageBatches,
                 later: LaterStageBatches, stages: ResidentStages, engine_id: int):
        self.pool = pool
        self.requests = requests
        self.order = order
        self.first = first
        self.later = later
        self.stages = stages
        self.engine_id = engine_id

    # ------------------------------------------------------------------ decode fast-forward
    # simulator/fastpath/fast_forward.py calls these when it has proved that the next k cycles
    # of one decode batch run undisturbed: no other work on the engines of its route, no
    # request finishing, KV growing into free blocks.
    def advance_first_decode(self, batch: ScheduledBatch, k: int) -> None:
        """First stage: `batch` (a decode batch just formed by `schedule`, all members running)
        completes, its tokens come back and the same members form k - 1 further batches that
        complete in turn; after the k-th completion their tokens arrive and they wait in the
        decode queue, ready for the next `schedule`."""
        st = self._check_bulk(batch.model, batch.stage, k)
        if not st.is_first or batch.kind != DECODE:
            raise ProtocolError(f"advance_first_decode: {batch.batch_id} is not a first-stage decode batch")
        reqs = [self._bulk_member(sr.req_id, RUNNING) for sr in batch.requests]
        # cycle i < k - 1 completes batch i (context + 1), receives its tokens and forms batch
        # i + 1, growing each member (in batch order) to cover its context + 1
        self._grow_in_order(reqs, 2, k - 1)
        for req in reqs:
            req.context_len += k - 1
        self.order.decisions += k - 1
        self.first.batch_seq += k - 1
        q = st.decode_q
        for req in reqs:  # the k-th completion and its token message
            req.context_len += 1
            req.generated += k
            req.transition(BLOCKED)
            req.transition(WAITING_DECODE)
            q.push(req, self.order.decisions)

    def advance_later_decode(self, model: str, stage: int, req_ids: list[str], k: int) -> None:
        """Later stage: k decode batches of exactly `req_ids` (all blocked here) arrive, run and
        complete one after another; the members end blocked, k tokens further on."""
        st = self._check_bulk(model, stage, k)
        if st.is_first:
            raise ProtocolError(f"advance_later_decode: {model} stage {stage} is a first stage")
        reqs = [self._bulk_member(rid, BLOCKED) for rid in req_ids]
        self._grow_in_order(reqs, 1, k)  # cycle i: each member covers its context + 1, then runs
        for req in reqs:
            req.context_len += k
        if st.is_last:
            for req in reqs:
                req.generated += k
        self.requests.seq += k
        self.order.decisions += k

    # ------------------------------------------------------------------ joint replay
    # simulator/fastpath/ replays several decode batches interleaved on one engine (a
    # pipeline's stage and one-stage replicas); it computes every decision itself and applies
    # the outcome with these calls: the members' states and queues, then the engine's KV growth
    # in decision order, its counters and its queues' ages.
    def replay_first_decode(self, model: str, req_ids: list[str], k: int | list[int], since: int, running: bool) -> None:
        """A one-stage replica: the members (running in a batch just formed if `running`, else
        waiting in the decode queue, of which they are the whole content) go through k cycles
        (formed, completed, tokens back; k per member if a list: one that joined the batch later
        ran fewer, maybe none) and end waiting in the decode queue, which became non-empty at
        decision `since`. KV growth: `replay_grows`."""
        ks = k if isinstance(k, list) else [k] * len(req_ids)
        st = self._check_bulk(model, 0, max(ks))
        reqs = [self._bulk_member(rid, RUNNING if running else WAITING_DECODE) for rid in req_ids]
        q = st.decode_q
        if not running:
            if len(q.items) != len(reqs):
                raise ProtocolError(f"replay_first_decode: {model}'s decode queue on engine {self.engine_id} holds other requests")
            q.pop_front(len(reqs))
            for req, n in zip(reqs, ks):
                if n:
                    req.transition(RUNNING)
        for req, n in zip(reqs, ks):
            if n:
                req.context_len += n
                req.generated += n
                req.transition(BLOCKED)
                req.transition(WAITING_DECODE)
        for req in reqs:
            q.push(req, since)

    def replay_pipeline_first(self, model: str, members: list[tuple[str, int, int, str | None]]) -> None:
        """A pipeline's first stage: each (request, context, tokens, batch id) ends blocked in
        that batch (awaiting its token) or, with batch id None, waiting in the decode queue."""
        st = self._check_bulk(model, 0, 1)
        q = st.decode_q
        if q.items:
            q.pop_front(len(q.items))
        waiting = []
        live = self.requests.live
        for rid, ctx, generated, bid in members:
            req = live[rid]
            st.leave_inflight(req)
            req.context_len = ctx
            req.generated = generated
            if bid is None:
                req.state = WAITING_DECODE
                waiting.append(req)
            else:
                req.state = BLOCKED
                st.enter_inflight(req, bid, decode=True)
        for req in waiting:
            q.push(req, self.order.decisions)

    def replay_pipeline_later(self, model: str, stage: int, members: list[tuple[str, int, int]], served: int) -> None:
        """A pipeline's later stage: the first `served` received batches waiting here ran; each
        (request, context, tokens) ends blocked (the tokens count on the last stage only)."""
        st = self._check_bulk(model, stage, 1)
        if served:
            st.decode_q.pop_front(served)
        live = self.requests.live
        for rid, ctx, generated in members:
            req = live[rid]
            req.context_len = ctx
            if st.is_last:
                req.generated = generated
            req.state = BLOCKED

    def restore_counters(self, decisions: int, seq: int) -> None:
        """The decision count and the last sequence number as at an earlier instant, for a
        protocol call the replay makes as at that instant (`receive_batch` of a batch that
        arrived in the replay, `add_request` of a request it admitted)."""
        self.order.decisions = decisions
        self.requests.seq = seq

    def replay_grows(self, grows: list) -> None:
        """The replayed decisions' KV growth, (allocation, target tokens), and the frees of the
        requests that finished, (None, request id), in their order. (A request whose prompt the
        replay formed is named by its id: its allocation was made at the cut.)"""
        pool = self.pool
        grow = pool.grow
        for alloc, target in grows:
            if alloc is None:
                pool.release(target)
            else:
                if alloc.__class__ is str:
                    alloc = pool.get(alloc)
                grow(alloc, target)

    def replay_finish(self, model: str, req_ids: list[str]) -> None:
        """One-stage replica members (waiting in its decode queue) that produced their last
        token in the replay: gone, as `receive_tokens` leaves them; their KV is freed by
        `replay_grows`, in order with the growth."""
        st = self._check_bulk(model, 0, 1)
        q = st.decode_q
        for rid in req_ids:
            req = self._bulk_member(rid, WAITING_DECODE)
            q.remove(req)
            self._replay_gone(req)

    def replay_pipeline_gone(self, model: str, stage: int, req_ids: list[str]) -> None:
        """A pipeline's requests that produced their last token in the replay (on the first
        stage: whose token came back): gone from this stage, as `EngineScheduler.free` leaves
        them (after `replay_pipeline_first` / `replay_pipeline_later`); their KV is freed by
        `replay_grows`, in order with the growth."""
        st = self._check_bulk(model, stage, 1)
        for rid in req_ids:
            req = self.requests.live.get(rid)
            if req is None or req.state not in (BLOCKED, RUNNING, WAITING_DECODE) or req.abort_pending:
                raise ProtocolError(f"replay_pipeline_gone: request {rid!r} is not a live decode request on engine {self.engine_id}")
            st.leave_inflight(req)
            self._replay_gone(req)

    def replay_form_prefill(self, model: str, now: float, decisions: int, batch_seq: int) -> ScheduledBatch:
        """The decision forming the prompt batch of the one request waiting in `model`'s prefill
        queue at `now`, after `decisions` decisions and `batch_seq` batches formed here, as
        `schedule` makes it (the replay proved the choice and the admission; the counters end
        as `replay_counters` sets them)."""
        st = self._check_bulk(model, 0, 1)
        if len(st.prefill_q.items) != 1:
            raise ProtocolError(f"replay_form_prefill: {model}'s prefill queue on engine {self.engine_id} does not hold one request")
        self.order.decisions = decisions
        first = self.first
        seq, first.batch_seq = first.batch_seq, batch_seq
        batch = self.order.attempt(st.prefill_q, now)  # as the policy serves it
        first.batch_seq = seq
        if batch is None or batch.swap_out or batch.swap_in:
            raise ProtocolError(f"replay_form_prefill: {model}'s prompt on engine {self.engine_id} is not admitted")
        self.order.decisions += 1
        return batch

    def replay_form(self, model: str, n: int, now: float) -> ScheduledBatch:
        """The decision forming a one-stage replica's decode batch of its n waiting members
        (the whole queue) at `now`, as `schedule` makes it (the replay proved the choice and
        that the KV fits; a starvation promotion is counted with `replay_counters`)."""
        st = self._check_bulk(model, 0, 1)
        if len(st.decode_q.items) != n:
            raise ProtocolError(f"replay_form: {model}'s decode queue on engine {self.engine_id} does not hold {n} requests")
        batch = self.first.decode(st, n, now)
        if batch is None or len(batch.requests) != n or batch.swap_out or batch.swap_in:
            raise ProtocolError(f"replay_form: {model}'s {n} requests on engine {self.engine_id} do not fit")
        self.order.decisions += 1
        return batch

    def replay_counters(self, decisions: int, seq: int, formed: int, promotions: int) -> None:
        """After the replayed decisions: the decision count, the sequence number (received
        batches), first-stage batches formed, and the starvation promotions among them."""
        self.order.decisions = decisions
        self.requests.seq = seq
        self.first.batch_seq += formed
        self.order.promotions += promotions

    def replay_ages(self, model: str, since: int, others: list[tuple[str, int]]) -> None:
        """The decision at which each non-empty decode queue (the pipeline's stage of `model`
        here, and each one-stage (model, since) of `others`) was last served or became non-empty."""
        for m, when in [(model, since), *others]:
            q = self._resident(m).decode_q
            if q.items and q.since != when:
                q.touch(when)

    # ------------------------------------------------------------------ helpers
    def _grow_in_order(self, reqs: list[StageRequest], offset: int, cycles: int) -> None:
        """The KV growth of `cycles` cycles in which cycle i takes every member, in order, to
        cover context_len + i + offset tokens: the same `grow` calls (same targets, same
        order: by cycle, then member) as doing the cycles one by one, without visiting the
        cycles where nobody crosses a block boundary."""
        grows = []
        for j, req in enumerate(reqs):
            alloc, c = req.alloc, req.context_len
            tpb = alloc.tokens_per_block
            i = max(0, alloc.blocks_per_layer * tpb - c - offset + 1)  # first cycle needing a block
            while i < cycles:
                target = c + i + offset
                grows.append((i, j, target))
                i = max(i + 1, -(-target // tpb) * tpb - c - offset + 1)
        grows.sort()
        grow = self.pool.grow
        for _, j, target in grows:
            grow(reqs[j].alloc, target)

    def _replay_gone(self, req: StageRequest) -> None:
        """A request that finished in a replay leaves this engine, as `EngineScheduler.free`
        leaves it (its KV freed by `replay_grows`)."""
        req.state = FINISHED
        self.requests.retire(req, FINISHED)
        self.later.forget(req.req_id)

    def _resident(self, model: str) -> ResidentStage:
        """The stage of `model` resident here."""
        st = self.stages.of(model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no stage of model {model!r}")
        return st

    def _check_bulk(self, model: str, stage: int, k: int) -> ResidentStage:
        if k < 1:
            raise ProtocolError(f"bulk advance of {k} cycles; give at least one")
        if self.requests.track_history:
            raise ProtocolError("bulk advance skips state transitions; it cannot run with track_history")
        st = self.stages.at(model, stage)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no stage {stage} of {model!r}")
        return st

    def _bulk_member(self, req_id: str, state: str) -> StageRequest:
        req = self.requests.live.get(req_id)
        if req is None or req.state != state or req.abort_pending or req.alloc is None or req.alloc.on_host:
            raise ProtocolError(f"bulk advance: request {req_id!r} is not {state} with resident KV on engine {self.engine_id}")
        return req
