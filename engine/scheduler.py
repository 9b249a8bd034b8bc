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

States per (request, stage) follow the paper's Fig. 7 (engine/request.py).

Policies (engine/policies/, chosen by name)
-------------------------------------------
``full-batch-first`` (default, §5): (1) full decode batches (`max_batch_size` requests), then
(2) prefills (one request per prefill batch by default; `prefill_max_requests` and
`prefill_token_budget` allow packing), then (3) under-sized decode batches. Ascending arrival
order within each class, across all resident stages. ``prefill-first`` (vLLM-like): prefills
packed under the token budget first, then decodes. ``sarathi``: chunked prefill; each first-stage
batch takes the ready decodes plus prompt chunks up to the token budget, with at most
`num_stages` micro-batches of a model in flight.

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

No model starves (guarantee)
----------------------------
Every queue (a first stage's prefill queue and decode queue; a later stage's full-decode,
under-sized-decode and prefill batch queues) records the decision at which it last was served
or became non-empty. A non-empty queue not served for more than L decisions jumps ahead of the
policy's class order; starving queues go oldest head first. L is `starvation_limit`, by default
max(64, 4 x the number of queues on the engine) so that the policy's order rules in normal
operation; 0 disables the promotion. A served queue cannot starve again for L decisions, so
with L >= Q (the number of queues on the engine; the default ensures it) a queue whose head can
get KV is served within L + Q decisions, whatever other models do. Within a queue the oldest
request/batch goes first, and a first-stage decode batch takes up to `max_batch_size` of them. A chatty small model beside
a large one therefore cannot hold back the large model's under-sized decode batches for ever
(tests/test_scheduler_starvation.py).

Files: this module holds `EngineScheduler` (events in, `schedule`, `complete`, queries); its
mixins hold one job each: queue ordering and starvation (engine/queue_heaps.py), KV fitting and
swap planning (engine/kv_planning.py), batch formation (engine/batch_forming.py) and the
simulator's bulk decode advance (engine/bulk_advance.py); engine/queues.py has the queue types,
engine/scheduled.py what `schedule` and `complete` return.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping

from paraflex.errors import ConfigError, ParaflexError, UserError
from paraflex.engine.batch_forming import BatchForming
from paraflex.engine.block_pool import BlockPool, tokens_per_block
from paraflex.engine.bulk_advance import BulkAdvance
from paraflex.engine.kv_planning import KVPlanning
from paraflex.engine.messages import (
    DECODE,
    PREFILL,
    BatchMessage,
    FreeMessage,
    TokenEntry,
    TokenMessage,
)
from paraflex.engine.policies.inflight_bound import parse_inflight_limit
from paraflex.engine.queue_heaps import QueueHeaps
from paraflex.engine.queues import PendingBatch, Queue, ResidentStage
from paraflex.engine.request import (
    ABORTED,
    BLOCKED,
    FINISHED,
    RUNNING,
    SWAPPED_BLOCKED,
    SWAPPED_DECODE,
    WAITING_DECODE,
    WAITING_PREFILL,
    StageRequest,
)
from paraflex.engine.scheduled import Completion, ProtocolError, ScheduledBatch, ScheduledRequest

# the engine core's scheduler API, importable from here as before the split into mixins
__all__ = ["Completion", "EngineScheduler", "PendingBatch", "ProtocolError", "Queue", "ResidentStage",
           "ScheduledBatch", "ScheduledRequest"]

_GONE_MEMORY = 100_000  # ids of finished/aborted requests remembered to drop late messages


class EngineScheduler(QueueHeaps, KVPlanning, BatchForming, BulkAdvance):
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
    ):
        from paraflex.engine.policies import get_policy

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
        self.policy = get_policy(policy)
        self.prefill_token_budget = prefill_token_budget
        self.prefill_max_requests = prefill_max_requests or self.policy.default_prefill_max_requests(max_batch_size)
        self.starvation_limit = starvation_limit
        self.watermark_blocks = int(watermark * pool.capacity + 0.999999) if watermark else 0
        # free blocks kept when swapping in ahead of need, so the swap-in does not force an eviction
        self.headroom_blocks = max(self.watermark_blocks, pool.capacity // 10)
        self.engine_id = engine_id
        self.track_history = track_history
        self.decode_inflight_limit = parse_inflight_limit(decode_batches_in_flight)
        self.stages: list[ResidentStage] = []
        self._by_key: dict[tuple[str, int], ResidentStage] = {}
        self._first: dict[str, ResidentStage] = {}
        self._reqs: dict[str, StageRequest] = {}
        self._ages: list = []  # heap of (since, tick, queue): see Queue
        self._heaps: list[list] = [[] for _ in range(self.policy.num_classes)]  # per class: (head key, tick, queue)
        self._classify_on_len = self.policy.classify_on_len
        self._starvation_auto = 64
        self._swapped: set[StageRequest] = set()  # requests whose KV is in the host pool
        self._gone: OrderedDict[str, str] = OrderedDict()  # finished/aborted ids -> final state
        self._chunk_keys: dict[str, tuple] = {}  # later stages: req_id -> key of the batch with its latest chunk
        self._seq = 0
        self._batch_seq = 0
        self._last_pick: tuple | None = None  # (class, head key, queue) of the last policy pick; None if promoted
        self.decisions = 0
        self.stats = {"swap_out_blocks": 0, "swap_in_blocks": 0, "swap_outs": 0, "swap_ins": 0, "starvation_promotions": 0}

    @classmethod
    def from_config(cls, pool: BlockPool, scheduler_config, engine_id: int = 0) -> "EngineScheduler":
        """Build from a `paraflex.config.SchedulerConfig` (max_batch_size, policy, budget)."""
        return cls(
            pool,
            max_batch_size=scheduler_config.max_batch_size,
            policy=scheduler_config.policy,
            engine_id=engine_id,
            decode_batches_in_flight=getattr(scheduler_config, "decode_batches_in_flight", "stages"),
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
        if any(s.model == model for s in self.stages):
            raise ConfigError(f"{model}.stages", f"engine {self.engine_id} already hosts a stage of {model}; one engine holds at most one stage per model")
        st = ResidentStage(model, stage, num_layers, kv_bytes_per_token_per_layer, num_stages,
                           tokens_per_block(self.pool.block_bytes, kv_bytes_per_token_per_layer, model))
        if st.is_first:
            st.prefill_q, st.decode_q = Queue(st, "prefill", self), Queue(st, "decode", self)
        else:
            st.full_q, st.decode_q, st.prefill_q = Queue(st, "full", self), Queue(st, "decode", self), Queue(st, "prefill", self)
        self._starvation_auto = max(64, 4 * sum(len(x.queues()) for x in self.stages + [st]))
        self.stages.append(st)
        self._by_key[st.key] = st
        if st.is_first:
            self._first[model] = st
        return st

    def stage_of(self, model: str) -> ResidentStage:
        for st in self.stages:
            if st.model == model:
                return st
        raise ProtocolError(f"engine {self.engine_id} hosts no stage of model {model!r}")

    def kv_token_limits(self) -> dict[str, tuple[int, int]]:
        """Per resident model, what one request's KV may take of this engine's pool for its
        stage: (prompt tokens a first stage admits into an otherwise empty pool, above the
        watermark; tokens of its whole context, prompt + max_tokens - 1). Serving backends
        refuse a request over either up front (paraflex/admission.py): it could never run."""
        out = {}
        for st in self.stages:
            per_layer = self.pool.capacity // st.num_layers
            prompt = (self.pool.capacity - self.watermark_blocks) // st.num_layers if st.is_first else per_layer
            out[st.model] = (prompt * st.tokens_per_block, per_layer * st.tokens_per_block)
        return out

    # ------------------------------------------------------------------ events in
    def add_request(self, req_id: str, model: str, prompt_len: int, max_new_tokens: int, arrival_time: float,
                    prompt_token_ids: list[int] | None = None, sampling: dict | None = None) -> StageRequest:
        """A new request at its model's first stage (state waiting-prefill)."""
        st = self._first.get(model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no first stage of {model!r}; dispatch to the replica's first engine")
        if req_id in self._reqs or req_id in self._gone:
            raise ProtocolError(f"request id {req_id!r} already used on engine {self.engine_id}; request ids must be unique")
        if prompt_len < 1:
            raise ConfigError("prompt_len", f"request {req_id!r} has {prompt_len} prompt tokens; send at least one")
        if max_new_tokens < 1:
            raise ConfigError("max_tokens", f"request {req_id!r} asks for {max_new_tokens} new tokens; ask for at least one")
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_len:
            raise ProtocolError(f"request {req_id!r}: prompt_len {prompt_len} != len(prompt_token_ids) {len(prompt_token_ids)}")
        longest = prompt_len + max_new_tokens - 1  # the last token is never fed back
        blocks = -(-longest // st.tokens_per_block) * st.num_layers
        if blocks > self.pool.capacity:
            raise UserError(
                f"request {req_id!r}: {prompt_len} prompt tokens + max_tokens {max_new_tokens} need {blocks} KV blocks "
                f"at {model} stage 0, but engine {self.engine_id} holds {self.pool.capacity}; shorten the prompt or lower max_tokens "
                f"(or give the engine more KV memory: cluster.memory_gb, or fewer stages per engine)"
            )
        req = self._new_request(req_id, st, arrival_time, prompt_len, max_new_tokens, sampling,
                                list(prompt_token_ids) if prompt_token_ids is not None else None)
        st.prefill_q.push(req, self.decisions)
        return req

    def receive_batch(self, msg: BatchMessage) -> bool:
        """A batch formed upstream arrives at a later stage; it runs later as one batch. False
        when none of its requests is live here any more (nothing will run: drop its tensors)."""
        st = self._by_key.get((msg.model, msg.stage))
        if st is None or st.is_first:
            raise ProtocolError(f"engine {self.engine_id} hosts no later stage {msg.stage} of {msg.model!r}")
        self._seq += 1
        pb = PendingBatch(msg, self._seq)
        row = 0
        floor = None  # key of the latest batch holding an earlier chunk of one of our prompts
        for e in msg.prefills:
            if e.req_id in self._gone:  # ended here already: its rows are not run
                row += e.num_tokens
                pb.dropped = True
                continue
            req = self._reqs.get(e.req_id)
            if req is None:
                req = self._new_request(e.req_id, st, e.arrival, e.prompt_len, e.max_new_tokens, e.sampling, None)
            elif req.state == BLOCKED:
                req.transition(WAITING_PREFILL)
            elif req.state not in (WAITING_PREFILL, RUNNING):  # RUNNING: its previous chunk runs now
                raise ProtocolError(f"prefill chunk for {e.req_id!r} at {st.model}/{st.stage} in state {req.state}")
            if req.pending_chunks or req.state == RUNNING:  # an earlier chunk waits or runs here
                prev = self._chunk_keys.get(e.req_id)
                if prev is not None and (floor is None or prev > floor):
                    floor = prev
            req.pending_chunks += 1
            pb.prefills.append((req, e))
            pb.rows.append((row, row + e.num_tokens))
            row += e.num_tokens
        for e in msg.decodes:
            if e.req_id in self._gone:
                row += 1
                pb.dropped = True
                continue
            req = self._reqs.get(e.req_id)
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
            self._chunk_keys[req.req_id] = pb.key
        pb.queue = self._pending_queue(st, pb)
        pb.queue.push(pb, self.decisions)
        return True

    def receive_tokens(self, msg: TokenMessage) -> None:
        """Tokens sampled by the last stage arrive at the first stage."""
        st = self._first.get(msg.model)
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no first stage of {msg.model!r} for token message {msg.batch_id}")
        for e in msg.entries:
            req = self._reqs.get(e.req_id)
            if req is None:
                if e.req_id in self._gone:
                    continue
                raise ProtocolError(f"token for unknown request {e.req_id!r} at {msg.model} first stage")
            if req.abort_pending:
                continue
            if e.finished:
                self._finish(req, FINISHED)
                continue
            self._leave_inflight(st, req)
            if not st.is_last:  # a one-stage model counted the token in complete() already
                req.generated += 1
            if req.token_ids is not None and e.token_id is not None:
                req.token_ids.append(e.token_id)
            req.transition(WAITING_DECODE if req.state == BLOCKED else SWAPPED_DECODE)
            st.decode_q.push(req, self.decisions)

    def free(self, req_id: str) -> bool:
        """Request finished: free its KV here. Idempotent; False if nothing was held."""
        req = self._reqs.get(req_id)
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
        req = self._reqs.get(req_id)
        if req is None:
            self._remember(req_id, ABORTED)
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
        """The next batch to run on this engine, or None if nothing can run now."""
        batch = None
        self._last_pick = None
        if self.starvation_limit != 0:
            batch = self._serve_starving(now)
        if batch is None:
            batch = self.policy.pick(self, now)
        if batch is not None:
            self.decisions += 1
            if self._swapped and not batch.swap_out:
                self._swap_in_ahead(batch)
        return batch

    def complete(self, batch: ScheduledBatch, tokens: Mapping[str, int] | None = None,
                 stopped: Collection[str] = ()) -> Completion:
        """The worker finished `batch`: requests move on (blocked, waiting, finished)."""
        st = self._by_key[(batch.model, batch.stage)]
        done = Completion(batch.batch_id)
        entries = []
        for sr in batch.requests:
            req = self._reqs.get(sr.req_id)
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
                st.prefill_q.push(req, self.decisions)
            elif nxt == BLOCKED and st.is_first:
                req.batch_id = batch.batch_id
                st.inflight[batch.batch_id] = st.inflight.get(batch.batch_id, 0) + 1
                if batch.kind != PREFILL:
                    st.decode_inflight.add(batch.batch_id)
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

    def has_queued(self, model: str) -> bool:
        """Whether this engine's stage of `model` has work waiting in a queue."""
        st = self.stage_of(model)
        return any(q.items for q in st.queues())

    @property
    def has_swapped(self) -> bool:
        """Whether some request's KV on this engine is in the host pool."""
        return bool(self._swapped)

    # ------------------------------------------------------------------ queries
    def state_of(self, req_id: str) -> str | None:
        req = self._reqs.get(req_id)
        if req is not None:
            return req.state
        return self._gone.get(req_id)

    def request(self, req_id: str) -> StageRequest | None:
        return self._reqs.get(req_id)

    def live_requests(self) -> list[StageRequest]:
        return list(self._reqs.values())

    @property
    def num_live(self) -> int:
        return len(self._reqs)

    def has_ready_work(self) -> bool:
        """Whether some queue holds work (it may still wait for KV)."""
        return any(len(q) for st in self.stages for q in st.queues())

    def check(self) -> None:
        """Raise ParaflexError if scheduler or pool invariants are broken (used by tests)."""
        self.pool.check()
        for rid, req in self._reqs.items():
            alloc = self.pool.get(rid)
            if alloc is not req.alloc:
                raise ParaflexError(f"{rid!r}: the request's allocation is not the pool's")
            if req.swapped != (alloc is not None and alloc.on_host):
                raise ParaflexError(f"{rid!r} in state {req.state} but its KV is {'on host' if alloc and alloc.on_host else 'not on host'}")
            if alloc is not None and alloc.token_capacity < req.context_len:
                raise ParaflexError(f"{rid!r} has {req.context_len} tokens of context but KV for {alloc.token_capacity}")
        for rid in self._gone:
            if rid in self.pool:
                raise ParaflexError(f"{rid!r} is {self._gone[rid]} but still holds KV")
        for st in self.stages:
            for q in st.queues():
                keys = [x.key for x in q.items]
                if keys != sorted(keys):
                    raise ParaflexError(f"{q!r} is out of arrival order")

    # ------------------------------------------------------------------ helpers for policies
    def _new_request(self, req_id, st, arrival, prompt_len, max_new, sampling, token_ids) -> StageRequest:
        self._seq += 1
        req = StageRequest(req_id, st.model, st.stage, arrival, self._seq, prompt_len, max_new, sampling,
                           token_ids, self.track_history)
        self._reqs[req_id] = req
        return req

    def _pending_queue(self, st: ResidentStage, pb: PendingBatch) -> Queue:
        if pb.msg.kind == PREFILL:
            return st.prefill_q
        if pb.msg.kind == DECODE and len(pb) >= self.max_batch_size:
            return st.full_q
        return st.decode_q

    def decode_inflight_full(self, st: ResidentStage) -> bool:
        """Whether the first stage `st` of a multi-stage model already has as many decode
        batches in flight as the in-flight bound allows (`decode_batches_in_flight`): then an
        under-sized decode batch waits and the requests whose tokens come back meanwhile join
        them (see engine/policies/inflight_bound.py). Always False for one-stage models and
        with the bound off (None: the paper's unbounded rule)."""
        limit = self.decode_inflight_limit
        if limit is None or st.num_stages == 1:
            return False
        return len(st.decode_inflight) >= limit.cap(st.num_stages)

    def _remember(self, req_id: str, state: str) -> None:
        self._gone[req_id] = state
        if len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    def _leave_inflight(self, st: ResidentStage, req: StageRequest) -> None:
        if st.is_first and req.state in (BLOCKED, SWAPPED_BLOCKED) and req.batch_id is not None:
            n = st.inflight.get(req.batch_id, 0) - 1
            if n > 0:
                st.inflight[req.batch_id] = n
            else:
                st.inflight.pop(req.batch_id, None)
                st.decode_inflight.discard(req.batch_id)
            req.batch_id = None

    def _finish(self, req: StageRequest, final: str) -> None:
        st = self._by_key[(req.model, req.stage)]
        self._leave_inflight(st, req)
        if req.state in (WAITING_PREFILL, WAITING_DECODE, SWAPPED_DECODE):
            if st.is_first:
                q = st.prefill_q if req.state == WAITING_PREFILL else st.decode_q
                if req in q.items:
                    q.remove(req)
            else:
                self._drop_from_pending(st, req)
        req.transition(final)
        self.pool.release(req.req_id)
        req.alloc = None
        self._swapped.discard(req)
        del self._reqs[req.req_id]
        self._chunk_keys.pop(req.req_id, None)
        self._remember(req.req_id, final)

    def _drop_from_pending(self, st: ResidentStage, req: StageRequest) -> None:
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

    def _next_batch_id(self, st: ResidentStage) -> str:
        self._batch_seq += 1
        return f"{st.model}/e{self.engine_id}/{self._batch_seq}"
