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
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from heapq import heapify, heappop, heappush
from itertools import count
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from paraflex.errors import ConfigError, ParaflexError, UserError
from paraflex.engine.block_pool import BlockPool, tokens_per_block
from paraflex.engine.messages import (
    DECODE,
    MIXED,
    PREFILL,
    BatchMessage,
    DecodeEntry,
    FreeMessage,
    PrefillEntry,
    TokenEntry,
    TokenMessage,
)
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

_TICK = count()  # unique tie-break for the ages heap
_GONE_MEMORY = 100_000  # ids of finished/aborted requests remembered to drop late messages
_UNBOUNDED = 1 << 62  # repeatable_decisions: no other queue can interrupt


class ProtocolError(ParaflexError):
    """A driver broke the driving protocol (unknown stage, duplicate request, bad message)."""


@dataclass
class ResidentStage:
    """One stage of one model resident on this engine, with its queues."""

    model: str
    stage: int
    num_layers: int
    kv_bytes_per_token_per_layer: int
    num_stages: int
    tokens_per_block: int = 0
    # first stage: requests; later stages: PendingBatch objects; all sorted by arrival key
    prefill_q: "Queue" = field(default=None, repr=False)
    decode_q: "Queue" = field(default=None, repr=False)  # first stage: ready decodes; later: under-sized batches
    full_q: "Queue" = field(default=None, repr=False)  # later stages: full decode batches
    inflight: dict[str, int] = field(default_factory=dict, repr=False)  # first stage: batch_id -> requests awaiting a token
    key: tuple[str, int] = field(init=False, repr=False)
    is_first: bool = field(init=False, repr=False)
    is_last: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.key = (self.model, self.stage)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1

    def queues(self) -> tuple["Queue", ...]:
        return (self.prefill_q, self.decode_q) if self.is_first else (self.full_q, self.decode_q, self.prefill_q)


class Queue:
    """Items sorted by arrival key, plus the decision index it last was served/became non-empty.

    Every change of `since` also goes on the engine's `ages` heap, so that finding starving
    queues costs O(1) per decision while none starves.
    """

    __slots__ = ("items", "since", "stage", "name", "owner", "reg")

    def __init__(self, stage: ResidentStage, name: str, owner: "EngineScheduler"):
        self.items: list = []
        self.since = 0
        self.stage = stage
        self.name = name
        self.owner = owner
        self.reg: tuple | None = None  # (class, head key, tick) of its live entry in a class heap

    def touch(self, decision: int) -> None:
        """Mark the queue served (or newly non-empty) at `decision`."""
        self.since = decision
        heappush(self.owner._ages, (decision, next(_TICK), self))

    def push(self, item, decision: int) -> None:
        if not self.items:
            self.touch(decision)
        insort(self.items, item, key=_key)
        if self.items[0] is item or self.owner._classify_on_len:
            self.owner._requeue(self)

    def pop_front(self, n: int) -> None:
        del self.items[:n]
        self.owner._requeue(self)

    def remove(self, item) -> None:
        self.items.remove(item)
        self.owner._requeue(self)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"Queue({self.stage.model}/{self.stage.stage}.{self.name}, {len(self.items)})"


def _key(item):
    return item.key


class PendingBatch:
    """A batch received from upstream at a later stage, kept whole until it runs."""

    __slots__ = ("msg", "prefills", "decodes", "key", "seq", "rows", "dropped", "queue")

    def __init__(self, msg: BatchMessage, seq: int):
        self.msg = msg
        self.prefills: list[tuple[StageRequest, PrefillEntry]] = []
        self.decodes: list[tuple[StageRequest, DecodeEntry]] = []
        self.seq = seq
        self.key = (float("inf"), seq)
        self.rows: list[tuple[int, int]] = []  # received tensor rows of each live member
        self.dropped = False
        self.queue: Queue | None = None  # the queue it waits in

    def members(self) -> list[StageRequest]:
        return [r for r, _ in self.prefills] + [r for r, _ in self.decodes]

    def __len__(self) -> int:
        return len(self.prefills) + len(self.decodes)


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a scheduled batch: what the worker computes for it."""

    req_id: str
    kind: str  # "prefill" (a prompt chunk) | "decode"
    start_pos: int  # position of the first new token
    num_tokens: int  # new tokens this step
    context_len: int  # tokens with KV here after this step (attention span)
    block_table: list[list[int]]  # [layer][logical block] -> device block; read-only, valid until complete()
    token_ids: list[int] | None = None  # first stage: input token ids of this step (None in the simulator)
    samples: bool = False  # last stage: this step produces a token
    sampling: dict | None = None  # sampling params as a dict (last stage needs them)


@dataclass
class ScheduledBatch:
    """A batch for the worker (or the simulator's cost model) to execute."""

    batch_id: str
    model: str
    stage: int
    kind: str  # "prefill" | "decode" | "mixed"
    requests: list[ScheduledRequest]
    num_layers: int
    is_first: bool
    is_last: bool
    block_bytes: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), run first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block), run second
    message: BatchMessage | None = None  # for stage + 1; None on the last stage
    src_rows: list[tuple[int, int]] | None = None  # later stages: rows [a, b) of the received tensors to keep, in order; None = all
    formed_at: float = 0.0

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.requests]

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests if r.kind == PREFILL)

    @property
    def num_decodes(self) -> int:
        return sum(1 for r in self.requests if r.kind == DECODE)

    @property
    def total_context(self) -> int:
        """Sum of decode requests' context lengths (what a decode step's attention reads)."""
        return sum(r.context_len for r in self.requests if r.kind == DECODE)

    @property
    def swap_out_bytes(self) -> int:
        return len(self.swap_out) * self.block_bytes

    @property
    def swap_in_bytes(self) -> int:
        return len(self.swap_in) * self.block_bytes


@dataclass
class Completion:
    """What `complete` reports back to the driver."""

    batch_id: str
    token_message: TokenMessage | None = None  # last stage: send to the first stage
    finished: list[str] = field(default_factory=list)  # finished here: send FreeMessage to the other stages
    aborted: list[str] = field(default_factory=list)  # aborts that waited for this batch to end

    def free_message(self, model: str) -> FreeMessage | None:
        return FreeMessage(model, list(self.finished), "finished") if self.finished else None


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
                f"at {model} stage 0, but engine {self.engine_id} holds {self.pool.capacity}; shorten the prompt or lower max_tokens"
            )
        req = self._new_request(req_id, st, arrival_time, prompt_len, max_new_tokens, sampling,
                                list(prompt_token_ids) if prompt_token_ids is not None else None)
        st.prefill_q.push(req, self.decisions)
        return req

    def receive_batch(self, msg: BatchMessage) -> None:
        """A batch formed upstream arrives at a later stage; it runs later as one batch."""
        st = self._by_key.get((msg.model, msg.stage))
        if st is None or st.is_first:
            raise ProtocolError(f"engine {self.engine_id} hosts no later stage {msg.stage} of {msg.model!r}")
        self._seq += 1
        pb = PendingBatch(msg, self._seq)
        row = 0
        floor = None  # key of the latest batch holding an earlier chunk of one of our prompts
        for e in msg.prefills:
            if e.req_id in self._gone:
                row += e.num_tokens
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
            return
        pb.key = (min(r.arrival for r in pb.members()), pb.seq)
        # A later chunk must never sort ahead of the batch with the chunk before it (its head
        # would wait for that chunk, which waits behind it: a stall under chunked prefill).
        if floor is not None and floor[0] > pb.key[0]:
            pb.key = (floor[0], pb.seq)
        for req, _ in pb.prefills:
            self._chunk_keys[req.req_id] = pb.key
        pb.queue = self._pending_queue(st, pb)
        pb.queue.push(pb, self.decisions)

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

    # ------------------------------------------------------------------ bulk decode advance
    # The simulator's fast-forward (simulator/fast_forward.py) calls these when it has proved
    # that the next k cycles of one decode batch run undisturbed: no other work on the engines
    # of its route, no request finishing, KV growing into free blocks. They leave exactly the
    # state that k rounds of the protocol (complete / token message / schedule at the first
    # stage; receive_batch / schedule / complete at a later stage) would leave, with the same
    # blocks allocated in the same order; tests/test_sim_fast_forward.py pins this against
    # the step-by-step path.
    def advance_first_decode(self, batch: ScheduledBatch, k: int) -> None:
        """First stage: `batch` (a decode batch just formed by `schedule`, all members running)
        completes, its tokens come back and the same members form k - 1 further batches that
        complete in turn; after the k-th completion their tokens arrive and they wait in the
        decode queue, ready for the next `schedule`."""
        st = self._check_bulk(batch.model, batch.stage, k)
        if not st.is_first or batch.kind != DECODE:
            raise ProtocolError(f"advance_first_decode: {batch.batch_id} is not a first-stage decode batch")
        reqs = [self._bulk_member(sr.req_id, RUNNING) for sr in batch.requests]
        grow = self.pool.grow
        for _ in range(k - 1):  # complete batch i, receive its tokens, form batch i + 1
            for req in reqs:
                req.context_len += 1
                alloc = req.alloc
                if req.context_len + 1 > alloc.blocks_per_layer * alloc.tokens_per_block:
                    grow(alloc, req.context_len + 1)
        self.decisions += k - 1
        self._batch_seq += k - 1
        q = st.decode_q
        for req in reqs:  # the k-th completion and its token message
            req.context_len += 1
            req.generated += k
            req.transition(BLOCKED)
            req.transition(WAITING_DECODE)
            q.push(req, self.decisions)

    def advance_later_decode(self, model: str, stage: int, req_ids: list[str], k: int) -> None:
        """Later stage: k decode batches of exactly `req_ids` (all blocked here) arrive, run and
        complete one after another; the members end blocked, k tokens further on."""
        st = self._check_bulk(model, stage, k)
        if st.is_first:
            raise ProtocolError(f"advance_later_decode: {model} stage {stage} is a first stage")
        reqs = [self._bulk_member(rid, BLOCKED) for rid in req_ids]
        grow = self.pool.grow
        for _ in range(k):
            for req in reqs:
                alloc = req.alloc
                if req.context_len + 1 > alloc.blocks_per_layer * alloc.tokens_per_block:
                    grow(alloc, req.context_len + 1)
            for req in reqs:
                req.context_len += 1
        if st.is_last:
            for req in reqs:
                req.generated += k
        self._seq += k
        self.decisions += k

    def _check_bulk(self, model: str, stage: int, k: int) -> ResidentStage:
        if k < 1:
            raise ProtocolError(f"bulk advance of {k} cycles; give at least one")
        if self.track_history:
            raise ProtocolError("bulk advance skips state transitions; it cannot run with track_history")
        st = self._by_key.get((model, stage))
        if st is None:
            raise ProtocolError(f"engine {self.engine_id} hosts no stage {stage} of {model!r}")
        return st

    def _bulk_member(self, req_id: str, state: str) -> StageRequest:
        req = self._reqs.get(req_id)
        if req is None or req.state != state or req.abort_pending or req.alloc is None or req.alloc.on_host:
            raise ProtocolError(f"bulk advance: request {req_id!r} is not {state} with resident KV on engine {self.engine_id}")
        return req

    def repeatable_decisions(self, batch: ScheduledBatch) -> int:
        """For a first-stage decode batch `schedule` just formed: how many further decisions in
        a row would form it again from the same requests, if they were back in their decode
        queue and every other queue stayed as it is now. Each of those decisions tries that
        queue first when every other non-empty queue comes later in the policy's order (class,
        then head key); it ends when another queue would be promoted for starvation. 0 when
        this cannot be shown (the batch came from a promotion, or another queue comes first)."""
        st = self._by_key[(batch.model, batch.stage)]
        if st.decode_q.items:
            return 0
        others = [q for x in self.stages for q in x.queues() if q.items]
        if not others:
            return _UNBOUNDED
        pick = self._last_pick
        if pick is None or pick[2] is not st.decode_q:
            return 0
        mine = (pick[0], pick[1])
        for q in others:
            if q.reg is None or (q.reg[0], q.reg[1]) < mine:
                return 0
        limit = self.effective_starvation_limit
        if self.starvation_limit == 0:
            return _UNBOUNDED
        # decision j after this one runs with d = decisions + j - 1; q is promoted once d - q.since > limit
        return max(0, min(q.since for q in others) + limit + 1 - self.decisions)

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
            raise ProtocolError(
                f"engine {self.engine_id}: batch {pb.msg.batch_id} of {st.model} stage {st.stage} needs {whole} KV blocks, "
                f"the pool holds {self.pool.capacity}; give this engine KV for max_batch_size requests of full context"
            )
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

    # --- class heaps: each policy class keeps its non-empty queues ordered by head key -------
    def _requeue(self, q: Queue) -> None:
        """Re-register `q` in its policy class heap after its head or size changed."""
        if not q.items:
            q.reg = None
            return
        cls = self.policy.classify(self, q)
        key = q.items[0].key
        reg = q.reg
        if reg is not None and reg[0] == cls and reg[1] == key:
            return
        tick = next(_TICK)
        q.reg = (cls, key, tick)
        heap = self._heaps[cls]
        heappush(heap, (key, tick, q))
        if len(heap) > 4 * (len(self.stages) + 16):
            heap[:] = [e for e in heap if e[2].reg is not None and e[2].reg[2] == e[1]]
            heapify(heap)

    def pick_from_class(self, cls: int, now: float) -> ScheduledBatch | None:
        """Try the queues of one policy class, oldest head first; the first batch formed wins."""
        heap = self._heaps[cls]
        attempt = self.policy.attempt
        skipped = []
        batch = None
        while heap:
            entry = heap[0]
            reg = entry[2].reg
            if reg is None or reg[2] != entry[1]:
                heappop(heap)  # stale: the queue changed since
                continue
            batch = attempt(self, entry[2], now)
            if batch is not None:
                self._last_pick = (cls, entry[0], entry[2])
                break
            skipped.append(heappop(heap))
        for entry in skipped:
            heappush(heap, entry)
        return batch

    @property
    def effective_starvation_limit(self) -> int:
        """`starvation_limit`, or when it is None: max(64, 4 x the number of queues)."""
        if self.starvation_limit is not None:
            return self.starvation_limit
        return self._starvation_auto

    def _serve_starving(self, now: float) -> ScheduledBatch | None:
        ages = self._ages
        # drop stale heap entries (the queue was touched again, or emptied) from the top
        while ages and (ages[0][2].since != ages[0][0] or not ages[0][2].items):
            heappop(ages)
        if len(ages) > 8 * (len(self.stages) + 8):
            ages[:] = [a for a in ages if a[2].since == a[0] and a[2].items]
            heapify(ages)
        limit = self.effective_starvation_limit
        d = self.decisions
        if not ages or d - ages[0][0] <= limit:
            return None
        popped = {}  # id(queue) -> its live entry (a queue touched twice in one decision: keep one)
        while ages and d - ages[0][0] > limit:
            entry = heappop(ages)
            if entry[2].since == entry[0] and entry[2].items:
                popped[id(entry[2])] = entry
        batch = None
        for q in sorted((e[2] for e in popped.values()), key=lambda q: q.items[0].key):
            batch = self.policy.attempt(self, q, now)
            if batch is not None:
                self.stats["starvation_promotions"] += 1
                break
        for entry in popped.values():  # still starving (the served queue got a fresh entry)
            if entry[2].since == entry[0] and entry[2].items:
                heappush(ages, entry)
        return batch
