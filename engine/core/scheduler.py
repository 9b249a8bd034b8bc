"""The engine-local scheduler: which (model, stage, batch) an engine runs next (paper §5, §6.2).

Place in the data flow: ONE `EngineScheduler` per execution engine, holding the engine's
resident stages (`add_stage`) and its `BlockPool`. Two drivers use the very same object: the
torch engine loop (engine/, with a real worker and transport) and the discrete-event simulator
(simulator/, with a cost model). Neither changes a scheduling decision; they only move messages
and execute (or charge time for) what `schedule` returns. Pure Python: no torch, Ray or HTTP.

Driving protocol (the same for both drivers)
---------------------------------------------
Set-up, per engine::

    pool = BlockPool(num_blocks, block_bytes, host_num_blocks)
    sched = EngineScheduler(pool, max_batch_size=32, policy="full-batch-first")
    sched.add_stage(model, stage, num_layers, kv_bytes_per_token_per_layer, num_stages)

A stage may also join (`add_stage`) or leave (`remove_stage`) a running engine between batches
(live re-planning, paraflex/serving/live_placement.py); a joining stage takes its KV from the
shared pool's free blocks.

One engine hosts at most ONE stage of a model (the placement guarantees it, paper §6.3), so a
request id names at most one (request, stage) per engine.

Events in (any order the transport delivers them; each is a plain method call)::

    sched.add_request(req_id, model, prompt_len, max_new_tokens, arrival_time,
                      prompt_token_ids=None, sampling=None)   # first stage only (dispatcher picked it)
    sched.receive_batch(msg: BatchMessage)    # later stages: a batch formed upstream
    sched.receive_tokens(msg: TokenMessage)   # first stage: tokens sampled by the last stage
    sched.free(req_id)                        # finished: every stage (idempotent)
    sched.abort(req_id)                       # cancelled: every stage (idempotent, remembered)
    sched.handle(msg)                         # any of the three message types, dispatched

The engine loop (one batch in flight per engine)::

    batch = sched.schedule(now)          # -> ScheduledBatch | None (None: nothing runnable)
    # execute batch.swap_out copies (device -> host), THEN batch.swap_in (host -> device),
    # then the stage over batch.requests (block tables are layer-wise, physical device ids)
    done = sched.complete(batch, tokens={req_id: token_id}, stopped={req_ids hitting EOS/stop})
    # non-last stage: send batch.message (+ hidden tensors) to stage batch.stage + 1
    # last stage:     send done.token_message to the model's first stage (metadata only) and
    #                 FreeMessage(model, done.finished) to every other stage of the model

Events may arrive between `schedule` and `complete` (the simulator delivers them at their own
times; the torch loop between batches); only `free` of a running request is a protocol error,
an `abort` of one waits for `complete` (`Completion.aborted`). `add_request` refuses (UserError)
a request whose prompt + max_tokens can never fit this engine's pool; a received batch larger
than the whole pool raises ProtocolError at `schedule` instead of waiting for ever.

`tokens`/`stopped` matter on the last stage only (the simulator passes neither: a request
then finishes by length). The first stage forms decode batches continuously: a request
re-enters waiting-decode when its token arrives. Later stages run each batch exactly as the
first stage formed it (`batch_id` travels in the message); a member aborted meanwhile is
dropped and `ScheduledBatch.src_rows` tells the worker which rows of the received tensors to
keep. Every started request ends `finished` or `aborted`, and its KV is freed on every stage.

States per (request, stage) follow the paper's Fig. 7 (engine/core/request.py).

Policies (engine/core/policies/<name>.py, chosen by name): ``full-batch-first`` (default, §5:
full decode batches, then prefills, then under-sized decode batches; ascending arrival order
within each class, across all resident stages), ``prefill-first`` (vLLM-like) and ``sarathi``
(chunked prefill). A policy orders the queues and says how to serve one; every policy obeys the
same KV rules.

KV and swapping (§5 "Swapping policy", §6.2): a batch takes KV for its new tokens before it runs;
new prompts only into free blocks above a watermark, admitted work evicts (swaps out) when it
does not fit, nothing is ever recomputed; the rules are in engine/core/kv_planner.py.

Head starts (`head_start_s`, config `scheduler.head_start_s`; none by default, the paper's
arrival order): a model's requests are ordered as if they had arrived that many seconds
earlier, in every class of the policy and at every stage (their `arrival` is that ordering
time; latency metrics keep the real arrival outside the engine core). Measured for
dispersion-4x in docs/engine-core.md, "Round 5".

No model starves: a non-empty queue not served for more than `starvation_limit` decisions (by
default max(64, 4 x the number of queues)) jumps ahead of the policy's order, so every queue
whose head can get KV is served within a bounded number of decisions; the guarantee and its
bound are in engine/core/queue_order.py.

Parts (each owns its state; `EngineScheduler` wires them and holds no decision logic of its own
beyond `schedule` below): `QueueOrder` (engine/core/queue_order.py: the queues, the policy's
class heaps, the starvation promotion, the decision count); the policy
(engine/core/policies/<name>.py: the class of each queue, how a queue is served); the batch
formers `FirstStageBatches` (engine/core/first_stage_batches.py: decode, prompt and chunked
batches) and `LaterStageBatches` (engine/core/later_stage_batches.py: received batches, run as
formed); `KVPlanner` (engine/core/kv_planner.py: fitting a batch's KV, swap victims, the
watermark, swap-in ahead); `RequestTable` (engine/core/request_table.py: live and ended requests,
sequence numbers); `BulkAdvance` (engine/core/bulk_advance.py: the simulator's fast path's bulk
state moves). engine/core/queues.py has the queue types, engine/core/scheduled.py what
`schedule` and `complete` return.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import partial

from paraflex.errors import ConfigError, ParaflexError
from paraflex.engine.core.block_pool import BlockPool, tokens_per_block
from paraflex.engine.core.bulk_advance import BulkAdvance
from paraflex.engine.core.first_stage_batches import FirstStageBatches
from paraflex.engine.core.kv_planner import KVPlanner
from paraflex.engine.core.later_stage_batches import LaterStageBatches
from paraflex.engine.core.messages import PREFILL, BatchMessage, FreeMessage, TokenEntry, TokenMessage
from paraflex.engine.core.policies import Policy, get_policy
from paraflex.engine.core.policies.inflight_bound import parse_inflight_limit
from paraflex.engine.core.queue_order import Queue, QueueOrder
from paraflex.engine.core.queues import PendingBatch, ResidentStage, ResidentStages
from paraflex.engine.core.request import (ABORTED, BLOCKED, FINISHED, RUNNING, SWAPPED_DECODE, WAITING_DECODE,
                                          WAITING_PREFILL, StageRequest)
from paraflex.engine.core.request_table import RequestTable
from paraflex.engine.core.scheduled import Completion, ProtocolError, ScheduledBatch, ScheduledRequest

# the engine core's scheduler API, importable from here
__all__ = ["Completion", "EngineScheduler", "PendingBatch", "ProtocolError", "Queue", "ResidentStage",
           "ScheduledBatch", "ScheduledRequest"]


class EngineScheduler:
    """Per-engine scheduler over resident stages and one block pool (see module docstring)."""

    def __init__(
        self,
        pool: BlockPool,
        max_batch_size: int = 32,
        policy: str = "full-batch-first",
        prefill_token_budget: int = 4096,
        prefill_max_requests: int | None = None,
        starvation_limit: int | None = None,
        watermark: float = 0.01,
        engine_id: int = 0,
        track_history: bool = False,
        decode_batches_in_flight: int | str | None = "stages",
        head_start_s: Mapping[str, float] | None = None,
    ):
        if max_batch_size < 1:
            raise ConfigError("scheduler.max_batch_size", f"must be >= 1 (got {max_batch_size})")
        if prefill_token_budget < 1:
            raise ConfigError("scheduler.prefill_token_budget", f"must be >= 1 (got {prefill_token_budget})")
        if prefill_max_requests is not None and prefill_max_requests < 1:
            raise ConfigError("scheduler.prefill_max_requests", f"must be >= 1 (got {prefill_max_requests})")
        if starvation_limit is not None and starvation_limit < 0:
            raise ConfigError("scheduler.starvation_limit", f"must be >= 0 (0 disables, None = automatic; got {starvation_limit})")
        if not 0 <= watermark < 1:
            raise ConfigError("scheduler.watermark", f"must be in [0, 1) (got {watermark})")
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.prefill_token_budget = prefill_token_budget
        self.engine_id = engine_id
        self.decode_inflight_limit = parse_inflight_limit(decode_batches_in_flight)
        self.head_start_s = dict(head_start_s or {})
        self.resident = ResidentStages()
        self.stages: list[ResidentStage] = self.resident.all
        self.requests = RequestTable(track_history)
        self.order = QueueOrder(starvation_limit)
        self.policy = get_policy(policy)
        self.prefill_max_requests = prefill_max_requests or self.policy.default_prefill_max_requests(max_batch_size)
        self.kv = KVPlanner(pool, self.requests.live.values, self.stages, watermark)
        self.first_stage = FirstStageBatches(pool, self.kv, self.order, engine_id)
        self.later_stage = LaterStageBatches(pool, self.kv, self.order, self.requests, max_batch_size, engine_id)
        self.bulk = BulkAdvance(pool, self.requests, self.order, self.first_stage, self.later_stage, self.resident, engine_id)

    @property
    def policy(self) -> Policy:
        """The scheduling policy (engine/core/policies/): the class of each queue, how to serve one."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        self.order.follow(policy, partial(policy.attempt, self), self.max_batch_size)

    @classmethod
    def from_config(cls, pool: BlockPool, scheduler_config, engine_id: int = 0) -> "EngineScheduler":
        """Build from a `paraflex.config.schema.SchedulerConfig` (max_batch_size, policy, budget)."""
        return cls(
            pool,
            max_batch_size=scheduler_config.max_batch_size,
            policy=scheduler_config.policy,
            engine_id=engine_id,
            decode_batches_in_flight=getattr(scheduler_config, "decode_batches_in_flight", "stages"),
            head_start_s=getattr(scheduler_config, "head_start_s", None),
            # the config leaves the budget unset (None) unless the user gives one
            **({} if scheduler_config.prefill_token_budget is None
               else {"prefill_token_budget": scheduler_config.prefill_token_budget}),
        )

    # ------------------------------------------------------------------ set-up
    def add_stage(self, model: str, stage: int, num_layers: int, kv_bytes_per_token_per_layer: int, num_stages: int) -> ResidentStage:
        """Make (model, stage) resident on this engine; returns its entry."""
        if not 0 <= stage < num_stages:
            raise ConfigError(f"{model}.stage", f"stage {stage} outside 0..{num_stages - 1}")
        if num_layers < 1:
            raise ConfigError(f"{model}.num_layers", f"stage {stage} needs >= 1 layer (got {num_layers})")
        if self.resident.of(model) is not None:
            raise ConfigError(f"{model}.stages", f"engine {self.engine_id} already hosts a stage of {model}; one engine holds at most one stage per model")
        st = ResidentStage(model, stage, num_layers, kv_bytes_per_token_per_layer, num_stages,
                           tokens_per_block(self.pool.block_bytes, kv_bytes_per_token_per_layer, model))
        self.order.attach(st)
        self.resident.add(st)
        return st

    def remove_stage(self, model: str, abort_left: bool = False) -> list[str]:
        """Make `model`'s stage leave this engine (live re-planning) and drop its queues. Call
        between batches. Requests of it still here are refused (ProtocolError: drain first),
        or with `abort_left` aborted and their KV freed (the serving frontend drained or moved
        them first; these are leftovers whose free is still on its way). Returns the ids aborted."""
        st = self.stage_of(model)
        left = [r.req_id for r in self.requests.live.values() if r.model == model]
        if left and not abort_left:
            raise ProtocolError(f"engine {self.engine_id} still serves {model!r} ({len(left)} live requests); "
                                "drain before removing its stage")
        for rid in left:
            if self.requests.live[rid].state == RUNNING:
                raise ProtocolError(f"remove_stage({model!r}) while its batch runs; call it between batches")
            self.abort(rid)
        self.order.detach(st)
        self.resident.remove(model)
        return left

    def stage_of(self, model: str) -> ResidentStage:
        st = self.resident.of(model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no stage of model {model!r}")
        return st

    def kv_token_limits(self) -> dict[str, tuple[int, int]]:
        """Per resident model, what one request's KV may take of this engine's pool for its
        stage (`KVPlanner.token_limits`); serving backends refuse a request over either up
        front (paraflex/serving/admission.py): it could never run."""
        return self.kv.token_limits()

    # ------------------------------------------------------------------ events in
    def add_request(self, req_id: str, model: str, prompt_len: int, max_new_tokens: int, arrival_time: float,
                    prompt_token_ids: list[int] | None = None, sampling: dict | None = None) -> StageRequest:
        """A new request at its model's first stage (state waiting-prefill). The scheduler
        orders it by `arrival_time` minus its model's head start (`head_start_s`, 0 unless
        configured): the time its later stages order it by too, the arrival it carries in
        `PrefillEntry.arrival`."""
        st = self.resident.first_of(model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no first stage of {model!r}; dispatch to the replica's first engine")
        self.requests.check_new(req_id, prompt_len, max_new_tokens, prompt_token_ids, self.engine_id)
        self.kv.check_fits_ever(req_id, st, prompt_len, max_new_tokens, self.engine_id)
        order_time = arrival_time - self.head_start_s.get(model, 0.0)
        req = self.requests.open(req_id, st, order_time, prompt_len, max_new_tokens, sampling,
                                 list(prompt_token_ids) if prompt_token_ids is not None else None)
        st.prefill_q.push(req, self.order.decisions)
        return req

    def receive_batch(self, msg: BatchMessage) -> bool:
        """A batch formed upstream arrives at a later stage; it runs later as one batch. False
        when none of its requests is live here any more (nothing will run: drop its tensors)."""
        st = self.resident.at(msg.model, msg.stage)
        if st is None or st.is_first:
            raise ProtocolError(f"engine {self.engine_id} hosts no later stage {msg.stage} of {msg.model!r}")
        return self.later_stage.receive(st, msg)

    def receive_tokens(self, msg: TokenMessage) -> None:
        """Tokens sampled by the last stage arrive at the first stage."""
        st = self.resident.first_of(msg.model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no first stage of {msg.model!r} for token message {msg.batch_id}")
        live = self.requests.live
        for e in msg.entries:
            req = live.get(e.req_id)
            if req is None:
                if e.req_id in self.requests.gone:
                    continue
                raise ProtocolError(f"token for unknown request {e.req_id!r} at {msg.model} first stage")
            if req.abort_pending:
                continue
            if e.finished:
                self._finish(req, FINISHED)
                continue
            st.leave_inflight(req)
            if not st.is_last:  # a one-stage model counted the token in complete() already
                req.generated += 1
            if req.token_ids is not None and e.token_id is not None:
                req.token_ids.append(e.token_id)
            req.transition(WAITING_DECODE if req.state == BLOCKED else SWAPPED_DECODE)
            st.decode_q.push(req, self.order.decisions)

    def free(self, req_id: str) -> bool:
        """Request finished: free its KV here. Idempotent; False if nothing was held."""
        req = self.requests.live.get(req_id)
        if req is None:
            return False
        if req.state == RUNNING:
            raise ProtocolError(f"free({req_id!r}) while its batch runs at {req.model}/{req.stage}; free after complete()")
        self._finish(req, FINISHED)
        return True

    def abort(self, req_id: str) -> bool:
        """Cancel a request here (idempotent; later messages about it are dropped).

        If it is inside the running batch the abort waits for `complete`.
        """
        req = self.requests.live.get(req_id)
        if req is None:
            self.requests.remember(req_id, ABORTED)
            return False
        if req.state == RUNNING:
            req.abort_pending = True
            return True
        self._finish(req, ABORTED)
        return True

    def handle(self, msg) -> None:
        """Apply any engine-core message (batch, token or free)."""
        if isinstance(msg, BatchMessage):
            self.receive_batch(msg)
        elif isinstance(msg, TokenMessage):
            self.receive_tokens(msg)
        elif isinstance(msg, FreeMessage):
            for rid in msg.req_ids:
                self.abort(rid) if msg.reason == "aborted" else self.free(rid)
        else:
            raise ProtocolError(f"engine {self.engine_id}: cannot handle a {type(msg).__name__}")

    # ------------------------------------------------------------------ decisions
    def schedule(self, now: float = 0.0) -> ScheduledBatch | None:
        """The next batch to run on this engine, or None if nothing can run now: a queue past
        the starvation limit first (oldest head), else the policy's pick (its classes in
        order, oldest head first within a class); then, if the decision evicted nothing,
        swapped requests come back ahead of need."""
        batch = self.order.serve_starving(now)
        if batch is None:
            batch = self._policy.pick(self, now)
        if batch is not None:
            self.order.decisions += 1
            if self.kv.swapped and not batch.swap_out:
                self.kv.swap_in_ahead(batch)
        return batch

    def complete(self, batch: ScheduledBatch, tokens: Mapping[str, int] | None = None,
                 stopped: Collection[str] = ()) -> Completion:
        """The worker finished `batch`: requests move on (blocked, waiting, finished)."""
        st = self.resident.at(batch.model, batch.stage)
        done = Completion(batch.batch_id)
        entries = []
        live = self.requests.live
        for sr in batch.requests:
            req = live.get(sr.req_id)
            if req is None or req.state != RUNNING:
                raise ProtocolError(f"complete({batch.batch_id}): request {sr.req_id!r} is not running here")
            if sr.kind == PREFILL:
                req.prefilled += sr.num_tokens
                req.context_len = req.prefilled
                if not st.is_first:
                    req.pending_chunks -= 1
                    nxt = WAITING_PREFILL if req.pending_chunks else BLOCKED
                else:
                    nxt = WAITING_PREFILL if req.prefilled < req.prompt_len else BLOCKED
            else:
                req.context_len += 1
                nxt = BLOCKED
            if req.abort_pending:
                req.transition(nxt)
                self._finish(req, ABORTED)
                done.aborted.append(req.req_id)
                continue
            req.transition(nxt)
            if nxt == WAITING_PREFILL and st.is_first:
                st.prefill_q.push(req, self.order.decisions)
            elif nxt == BLOCKED and st.is_first:
                st.enter_inflight(req, batch.batch_id, decode=batch.kind != PREFILL)
            if st.is_last and sr.samples:
                req.generated += 1
                tok = tokens.get(req.req_id) if tokens is not None else None
                reason = "stop" if req.req_id in stopped else ("length" if req.generated >= req.max_new_tokens else None)
                entries.append(TokenEntry(req.req_id, tok, req.context_len, reason is not None, reason))
                if reason is not None and not st.is_first:
                    self._finish(req, FINISHED)
                    done.finished.append(req.req_id)
                elif reason is not None:
                    done.finished.append(req.req_id)  # the first stage frees it on the token message
        if st.is_last:
            done.token_message = TokenMessage(batch.model, batch.batch_id, entries)
        return done

    def _finish(self, req: StageRequest, final: str) -> None:
        """`req` ended here: out of its queue (or received batches), its KV released."""
        st = self.resident.at(req.model, req.stage)
        st.leave_inflight(req)
        if req.state in (WAITING_PREFILL, WAITING_DECODE, SWAPPED_DECODE):
            if st.is_first:
                q = st.prefill_q if req.state == WAITING_PREFILL else st.decode_q
                if req in q.items:
                    q.remove(req)
            else:
                self.later_stage.drop(st, req)
        req.transition(final)
        self.pool.release(req.req_id)
        req.alloc = None
        self.kv.forget(req)
        self.requests.retire(req, final)
        self.later_stage.forget(req.req_id)

    # ------------------------------------------------------------------ queries
    @property
    def decisions(self) -> int:
        """Batches `schedule` has formed on this engine."""
        return self.order.decisions

    @property
    def effective_starvation_limit(self) -> int:
        """The starvation limit in decisions (`starvation_limit`, or the automatic one)."""
        return self.order.effective_starvation_limit

    @property
    def stats(self) -> dict[str, int]:
        """Swap and starvation-promotion counters."""
        kv = self.kv
        return {"swap_out_blocks": kv.swap_out_blocks, "swap_in_blocks": kv.swap_in_blocks, "swap_outs": kv.swap_outs,
                "swap_ins": kv.swap_ins, "starvation_promotions": self.order.promotions}

    def has_queued(self, model: str) -> bool:
        """Whether this engine's stage of `model` has work waiting in a queue."""
        st = self.stage_of(model)
        return any(q.items for q in st.queues())

    @property
    def has_swapped(self) -> bool:
        """Whether some request's KV on this engine is in the host pool."""
        return bool(self.kv.swapped)

    def state_of(self, req_id: str) -> str | None:
        req = self.requests.live.get(req_id)
        if req is not None:
            return req.state
        return self.requests.gone.get(req_id)

    def request(self, req_id: str) -> StageRequest | None:
        return self.requests.live.get(req_id)

    def live_requests(self) -> list[StageRequest]:
        return list(self.requests.live.values())

    @property
    def num_live(self) -> int:
        return len(self.requests.live)

    def has_ready_work(self) -> bool:
        """Whether some queue holds work (it may still wait for KV)."""
        return any(len(q) for q in self.order.queues)

    def check(self) -> None:
        """Raise ParaflexError if scheduler or pool invariants are broken (used by tests)."""
        self.pool.check()
        self.requests.check(self.pool)
        for q in self.order.queues:
            keys = [x.key for x in q.items]
            if keys != sorted(keys):
                raise ParaflexError(f"{q!r} is out of arrival order")
