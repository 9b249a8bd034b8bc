"""Joint replay: a pipeline's decode batches and the one-stage batches on its engines, in closed form.

Place in the data flow: `Cluster.wakeup` offers it a multi-stage replica's first-stage decode
batch that the fast-forward's own pipeline replay (fast_forward.py) refuses because other work
shares the route's engines. In the base case llama-2-70b's 3-stage pipeline sits on engines
{0, 1, 2} and {3, 4, 5}, each also holding one-stage replicas of other models: the engines
alternate between the pipeline's batches (often several in flight, one per group of requests
that joined at different times) and those replicas' decode steps, so no batch can be replayed
alone, and step by step every pipeline cycle costs 6 events plus those of the steps between.

The group is the pipeline's route. When (checked at the moment its first engine formed the
batch, at time t):

- the policy is `full-batch-first`; every unfinished request of the pipeline replica is in a
  decode batch (fewer than `max_batch_size` in all): the one just formed, or one running at a
  later stage, queued there, or in flight as a batch or token message; no engine of the group
  holds swapped KV;
- every other stage on the group's engines is a one-stage replica whose unfinished requests
  (at most `max_batch_size`) are all in one decode batch, running or waiting in its decode
  queue (so every route touching the group lies inside it, and only new requests can reach it
  from outside); the events pending at the group are those batches' ends and the pipeline's;
- on each engine the queues' head keys differ in arrival time (their order cannot change);

every decision of the group is a function of the times, and the replay computes them with a
small event simulation of the group: an engine that becomes free, or receives work while idle,
decides after everything at that instant (as the event loop delivers) and picks what
`schedule` picks: a queue not served for more than the starvation limit first (oldest head),
else the least (policy class, head key); at the first stage the pipeline's waiting requests
form one batch; a later stage runs its oldest received batch. Stage times, hops and token
times are the event handlers' float expressions. It goes on while each decision is one it can
apply in bulk (no request's last token, KV growth within free blocks, its end before the
horizon: the first new request the dispatcher may send into the group, `_skip_arrivals`).

The cut, at the first instant it cannot replay: everything before is applied in bulk (per
engine the metrics in time order, the requests' states, queues and their ages, the KV growth in
decision order, the decision, message and batch counters; `EngineScheduler.replay_*`); what is
running then ends with a `ReplayEndEvent` (its effects applied, the engine decides for real
at its end); messages still in flight become real `BatchArrivalEvent`s / `TokenArrivalEvent`s.
Exactness is pinned by tests/test_sim_joint_replay.py (whole runs identical to step by step).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from heapq import heappop, heappush

from paraflex.costmodel import CostModel
from paraflex.engine.messages import DECODE, BatchMessage, DecodeEntry, TokenEntry, TokenMessage
from paraflex.engine.request import BLOCKED, RUNNING
from paraflex.simulator.events import ReplayEndEvent

_FULL, _SMALL = 0, 2  # full-batch-first's classes of decode queues
_END, _ARRIVE, _TOKENS = 10, 20, 30  # local events, in the event loop's order at one instant
_AWAITING = (BLOCKED, RUNNING)  # a first stage's requests whose coming token is under way


class _Stop(Exception):
    """A decision the replay cannot apply in bulk: cut here."""


class _Batch:
    """A decode batch of the pipeline: its requests (batch order), their positions (context
    before the step), its id and formation time at the first stage."""

    __slots__ = ("rids", "pos", "n", "csum", "bid", "formed_at", "head")

    def __init__(self, rids, pos, bid: str, formed_at: float, head: float):
        self.rids = rids
        self.pos = pos
        self.n = len(rids)
        self.csum = sum(pos)
        self.bid = bid
        self.formed_at = formed_at
        self.head = head  # the earliest arrival among its requests (its key at later stages)


class _Replica:
    """A one-stage replica's decode batch on its engine."""

    __slots__ = ("key", "rids", "recs", "order", "head", "since", "ready", "csum", "n", "fn", "left", "kv",
                 "formed", "times")

    def __init__(self, key, reqs, cls, fn, recs):
        self.key = key
        self.rids = [r.req_id for r in reqs]
        self.recs = recs
        self.head = min(r.key for r in reqs)
        self.order = (cls, self.head)  # its place in the policy's order
        self.since = 0
        self.ready = False
        self.n = len(reqs)
        self.csum = sum(r.context_len for r in reqs)
        self.fn = fn
        self.left = min(r.max_new_tokens - r.generated for r in reqs)  # tokens to its first last token
        self.kv = [_kv(r) for r in reqs]
        self.formed = 0  # batches formed by replayed decisions
        self.times: list[float] = []  # its token times


def _kv(req) -> list:
    """[token capacity, tokens per block, layers, context, allocation] of a request's KV here."""
    a = req.alloc
    return [a.blocks_per_layer * a.tokens_per_block, a.tokens_per_block, a.num_layers, req.context_len, a]


class _Engine:
    """One engine of the group during the replay."""

    __slots__ = ("eng", "j", "info", "d", "running", "blocks", "replicas", "queue", "since", "pkv", "pgen", "grows",
                 "busy", "received", "formed", "promotions", "limit", "taken", "messages", "batch_seq", "seq",
                 "arrivals", "queued", "served_queued", "bid_of", "started", "nready")

    def __init__(self, eng, j: int, info, limit: int):
        self.eng = eng
        self.j = j  # the pipeline's stage here
        self.info = info
        s = eng.scheduler
        self.d = s.decisions
        self.batch_seq = s._batch_seq
        self.seq = s._seq
        self.running = None  # (end, what): a _Replica, a _Batch, or the key of a held stage
        self.blocks = eng.pool.num_free
        self.replicas: list[_Replica] = []
        self.nready = 0  # replicas waiting in their decode queue
        self.queue: list = []  # the pipeline's queue here: waiting request ids (first stage) or _Batches
        self.since = 0  # its age
        self.pkv: dict = {}  # the pipeline's requests' KV here
        self.pgen: dict = {}  # later stages: each pipeline request's tokens counted here (the last stage's count)
        self.bid_of: dict = {}  # first stage: the batch each of its requests is in
        self.grows: list = []
        self.busy: list[tuple[float, float, int]] = []
        self.received = 0
        self.formed = 0
        self.promotions = 0
        self.limit = limit
        self.taken = None  # the StageEndEvent (or an earlier replay's ReplayEndEvent) it takes over
        self.messages: list = []  # the pipeline's message events to it, taken over
        self.arrivals: list = []  # later stages: (batch, decision count, receive index) of each received batch
        self.started = None  # the one-stage batch this engine formed at the start (no event yet)
        self.queued: set = set()  # later stages: ids of the batches queued at the start
        self.served_queued = 0  # later stages: how many of them ran


class JointReplay:
    """The joint replay of one simulated cluster (see the module docstring)."""

    def __init__(self, ff):
        """`ff`: the cluster's `DecodeFastForward` (arrivals, residents, `_skip_arrivals`)."""
        self.ff = ff
        self.cluster = ff.cluster
        # per engine: the (model, replica) of the one multi-stage replica whose route holds it, if one
        pipes: list[list] = [[] for _ in ff.cluster.engines]
        for model, routes in ff.cluster.replicas.items():
            for rho, route in enumerate(routes):
                if len(route) > 1:
                    for e in route:
                        pipes[e].append((model, rho))
        self.pipe_of = [p[0] if len(p) == 1 else None for p in pipes]
        self.decisions = 0  # decisions replayed (for the summary)

    # ------------------------------------------------------------------ entry
    def advance(self, eng, sb, t: float) -> bool:
        """Replay the group of the pipeline on `eng` from `sb` (the decode batch `eng` formed
        at t) on; True if it did (the engines then run on from the cut), False if nothing
        changed."""
        cluster = self.cluster
        pkey = self.pipe_of[eng.id]
        if (pkey is None or sb.kind != DECODE or sb.swap_in or sb.swap_out
                or eng.scheduler.policy.name != "full-batch-first" or not cluster.dispatcher.outstanding(pkey[0])[pkey[1]]):
            return False
        route = [cluster.engines[e] for e in cluster.replicas[pkey[0]][pkey[1]]]
        if not self._may_replay(eng, route, pkey[0]):
            return False
        state = self._state(eng, sb, route, pkey, t)
        if state is None:
            return False
        group, events, gen0 = state
        horizon = self._horizon(route, group, t)
        sim = _Sim(self, group, pkey, gen0, horizon)
        for ev in events:
            sim.push(*ev)
        sim.run()
        if not sim.decided:
            return False
        sim.apply()
        self.decisions += sim.decided
        return True

    @staticmethod
    def _may_replay(first, route, model: str) -> bool:
        """Quick refusals (most attempts): a prefill running on the route, a running one-stage
        batch or a pipeline request about to produce a request's last token."""
        for eng in route:
            if eng.wake_pending or eng.scheduler.has_swapped:
                return False
            ev = eng.running
            if eng is not first and eng.busy and not isinstance(ev, ReplayEndEvent):
                b = ev.batch
                if b is None or b.kind != DECODE:
                    return False
                if b.model != model:
                    req = eng.scheduler.request
                    for sr in b.requests:
                        r = req(sr.req_id)
                        if r.max_new_tokens - r.generated < 2:
                            return False
        for r in route[0].scheduler._reqs.values():
            if r.model == model and r.state in _AWAITING and r.max_new_tokens - r.generated < 2:
                return False
        return True

    def _state(self, first, sb, route, pkey, t):
        """(engines, initial local events, the pipeline's request data) or None if a condition
        fails. `first`: the engine that formed `sb` at t (it runs from t)."""
        cluster = self.cluster
        counts = cluster.dispatcher.outstanding
        records = cluster.records
        model, rho = pkey
        msgs = cluster.messages[pkey]
        events = []  # (time, kind, stage, what)
        group = []
        batches = []
        coming = []  # pipeline requests whose coming token is not yet produced
        waiting = 0  # pipeline requests waiting at the first stage
        in_tokens = 0  # pipeline requests whose token message is in flight
        pipe_events = 0
        for j, eng in enumerate(route):
            s = eng.scheduler
            if s.has_swapped or eng.wake_pending:
                return None
            info = eng.stages[model]
            es = _Engine(eng, j, info, 0 if s.starvation_limit == 0 else s.effective_starvation_limit)
            max_batch = s.max_batch_size
            pst = s.stage_of(model)
            if pst.prefill_q.items or (j and pst.full_q.items):
                return None
            expected = []  # times of the events pending here that the replay takes over
            if j:
                for pb in pst.decode_q.items:  # received batches waiting here
                    if pb.prefills or pb.dropped:
                        return None
                    b = self._batch_of(pb.msg, s)
                    es.queue.append(b)
                    batches.append(b)
                    coming.extend(b.rids)
                es.queued = set(map(id, es.queue))
            else:
                es.queue = [r.req_id for r in pst.decode_q.items]  # tokens back, waiting for a batch
                waiting = len(es.queue)
            if es.queue:
                es.since = pst.decode_q.since
            running = None  # a one-stage batch running here (real ScheduledBatch)
            if eng is first:
                running, start, end_ev = sb, t, None
            elif eng.busy:
                ev = eng.running
                if isinstance(ev, ReplayEndEvent):  # held by an earlier replay until its stage ends
                    expected.append(ev.time)
                    es.taken = ev
                    es.running = (ev.time, ev.key)
                    events.append((ev.time, _END, j, ev.key))
                    pipe_events += ev.key == pkey
                elif ev is None or ev.batch is None:
                    return None
                else:
                    running, start, end_ev = ev.batch, ev.start, ev.time
                    if running.kind != DECODE or running.swap_in or running.swap_out:
                        return None
                    expected.append(ev.time)
                    es.taken = ev
                    pipe_events += running.model == model
            if running is not None and running.model == model:  # a batch of the pipeline runs here
                rids = [sr.req_id for sr in running.requests]
                if j == 0:
                    b = _Batch(rids, [sr.start_pos for sr in running.requests], running.batch_id,
                               running.formed_at if end_ev is None else running.message.formed_at,
                               min(s.request(rid).arrival for rid in rids))
                else:
                    b = _Batch(rids, [sr.start_pos for sr in running.requests], running.batch_id,
                               running.message.formed_at if running.message else 0.0,
                               min(s.request(rid).arrival for rid in rids))
                if end_ev is None:
                    end_ev = t + eng.decode_time_fn(info, b.n)(b.csum + b.n)
                batches.append(b)
                coming.extend(rids)
                es.running = (end_ev, b)
                es.busy.append((start, end_ev, b.n))
                events.append((end_ev, _END, j, b))
                running = None
            elif running is not None and not (eng.stages[running.model].first and eng.stages[running.model].last):
                return None
            for ev in msgs:  # the pipeline's messages in flight to this engine
                if ev.engine is not eng:
                    continue
                msg = ev.message
                if j:
                    if msg.prefills:
                        return None
                    b = self._batch_of(msg, s)
                    events.append((ev.time, _ARRIVE, j, b))
                    coming.extend(b.rids)
                else:
                    if any(e.finished for e in msg.entries):
                        return None
                    b = _Batch([e.req_id for e in msg.entries], [e.position - 1 for e in msg.entries], msg.batch_id,
                               0.0, min(s.request(e.req_id).arrival for e in msg.entries))
                    events.append((ev.time, _TOKENS, 0, b))
                    in_tokens += b.n
                batches.append(b)
                expected.append(ev.time)
                es.messages.append(ev)
                pipe_events += 1
            if sorted(eng.pending) != sorted(expected):
                return None
            for r in s.live_requests():
                if r.model == model:
                    es.pkv[r.req_id] = _kv(r)
                    es.pgen[r.req_id] = r.generated
            if es.running is not None and isinstance(es.running[1], _Batch):  # the pipeline's, running: its step is done
                for rid in es.running[1].rids:
                    es.pkv[rid][3] += 1
                    es.pgen[rid] += 1
            for m, rinfo in eng.stages.items():
                if m == model:
                    continue
                if not (rinfo.first and rinfo.last):
                    return None
                st = s.stage_of(m)
                if st.prefill_q.items:
                    return None
                nr = counts(m)[rinfo.replica]
                q = st.decode_q
                if running is not None and running.model == m:
                    if q.items or len(running.requests) != nr:
                        return None
                    reqs = [s.request(sr.req_id) for sr in running.requests]
                elif nr:
                    if len(q.items) != nr:
                        return None
                    reqs = list(q.items)
                else:
                    continue
                if nr > max_batch:
                    return None
                r = _Replica((m, rinfo.replica), reqs, _FULL if nr >= max_batch else _SMALL,
                             eng.decode_time_fn(rinfo, nr), [records[x.req_id] for x in reqs])
                if running is not None and running.model == m:  # its step ends, its tokens come back
                    if r.left < 2:
                        return None
                    if end_ev is None:
                        end_ev = t + r.fn(r.csum + r.n)
                    for kv in r.kv:
                        kv[3] += 1
                    r.csum += r.n
                    r.left -= 1
                    r.times.append(end_ev)
                    r.since = es.d
                    es.running = (end_ev, r)
                    es.started = running if eng is first else None
                    es.busy.append((start, end_ev, r.n))
                    events.append((end_ev, _END, j, r))
                else:
                    r.ready = True
                    es.nready += 1
                    r.since = q.since
                es.replicas.append(r)
            if es.running is None and (es.queue or es.nready):
                return None  # idle with work waiting (for KV)
            group.append(es)
        if len(coming) + waiting + in_tokens != counts(model)[rho] or counts(model)[rho] >= route[0].scheduler.max_batch_size:
            return None
        if len(cluster.route_pending[pkey]) != pipe_events:
            return None
        heads = sorted([b.head for b in batches] + [r.head[0] for es in group for r in es.replicas])
        if any(a == b for a, b in zip(heads, heads[1:])):
            return None  # equal arrival times: an order could depend on sequence numbers
        s0 = route[0].scheduler
        gen0 = {}
        for r in s0.live_requests():
            if r.model == model:
                gen0[r.req_id] = r.generated
        if any(s0.request(rid).max_new_tokens - gen0[rid] < 2 for rid in coming):
            return None  # a coming token is a request's last
        e0 = group[0]
        for b in batches:
            for rid in b.rids:
                e0.bid_of[rid] = b.bid
        return group, events, gen0

    def _batch_of(self, msg, s) -> _Batch:
        return _Batch([e.req_id for e in msg.decodes], [e.position for e in msg.decodes], msg.batch_id, msg.formed_at,
                      min(s.request(e.req_id).arrival for e in msg.decodes))

    def _horizon(self, route, group: list[_Engine], t: float) -> float:
        """The first new request the dispatcher may send into the group (every route touching
        the group lies inside it, so nothing else can reach it)."""
        ff = self.ff
        seen = {eng.id for eng in route}
        frozen = {r.key for es in group for r in es.replicas}
        model = group[0].info.model
        frozen.add((model, group[0].info.replica))
        models = {m for eng in route for m in ff.models_on[eng.id]}
        horizon = float("inf")
        for m in models:
            ts = ff.arrivals.get(m)
            if ts:
                i = bisect_right(ts, t)
                if i < len(ts) and ts[i] < horizon:
                    i = ff._skip_arrivals(m, ts, i, horizon, seen, frozen)
                    if i < len(ts) and ts[i] < horizon:
                        horizon = ts[i]
        return horizon


class _Sim:
    """The group's event simulation from the start state to the cut, and its application."""

    def __init__(self, replay: JointReplay, group: list[_Engine], pkey, gen0: dict, horizon: float):
        cluster = replay.cluster
        self.cluster = cluster
        self.group = group
        self.pkey = pkey
        self.gen0 = gen0  # first stage: tokens each pipeline request received
        s0 = group[0].eng.scheduler
        self.req0 = {rid: s0.request(rid) for rid in gen0}
        self.horizon = horizon
        self.heap: list = []
        self.seq = 0
        self.decided = 0
        self.tokens: list = []  # (batch, time) of the pipeline's tokens, in time order
        self.hops: list[int] = []  # bytes of each replayed hop
        self.arch = group[0].info.arch
        self.back = cluster.interconnect.latency_s
        self.last = len(group) - 1
        self.held: list[_Engine] = []  # engines that decide for real at the cut instant
        self.cut = None

    def push(self, time: float, kind: int, j: int, what) -> None:
        heappush(self.heap, (time, kind, self.seq, j, what))
        self.seq += 1

    def run(self) -> None:
        heap = self.heap
        group = self.group
        horizon = self.horizon
        handle = self._handle
        while heap and heap[0][0] < horizon:
            x, kind, _, j, what = heappop(heap)
            handle(kind, group[j], what, x)
            if heap and heap[0][0] == x:  # several events at this instant: all first, then decisions
                woken = {j}
                while heap and heap[0][0] == x:
                    _, kind, _, j, what = heappop(heap)
                    handle(kind, group[j], what, x)
                    woken.add(j)
                order = sorted(woken)
            else:
                order = (j,)
            last = order[-1]
            for i in order:  # each engine touched at x decides (after everything at x)
                es = group[i]
                if es.running is None and (es.queue or es.nready):
                    try:
                        self._decide(es, x, i == last)
                    except _Stop:
                        self.cut = x
                        self.held = [group[k] for k in order if k >= i and group[k].running is None
                                     and (group[k].queue or group[k].nready)]
                        return

    def _handle(self, kind: int, es: _Engine, what, x: float) -> None:
        if kind == _END:
            es.running = None
            if isinstance(what, tuple):  # the end of a stage an earlier replay accounted for
                pass
            elif isinstance(what, _Replica):
                what.ready = True
                es.nready += 1
            elif es.j < self.last:
                nbytes = CostModel.hidden_bytes(self.arch, what.n)
                self.hops.append(nbytes)
                self.push(x + self.cluster.interconnect.transfer_time(nbytes), _ARRIVE, es.j + 1, what)
            else:
                self.tokens.append((what, x))
                self.push(x + self.back, _TOKENS, 0, what)
        elif kind == _ARRIVE:
            if not es.queue:
                es.since = es.d
            insort(es.queue, what, key=_batch_head)
            es.received += 1
            es.arrivals.append((what, es.d, es.received))
        else:  # tokens back at the first stage: its requests wait for the next batch
            if not es.queue:
                es.since = es.d
            gen0, req0 = self.gen0, self.req0
            for rid in what.rids:
                gen0[rid] += 1
                insort(es.queue, rid, key=lambda r: req0[r].key)
                es.bid_of.pop(rid)

    def _decide(self, es: _Engine, x: float, last: bool) -> None:
        """The decision `schedule` makes at x (every attempt succeeds: the serve checks KV);
        `last`: no other engine decides at x after this one."""
        limit = es.limit
        d = es.d
        best = best_order = None
        starving = []
        for r in es.replicas:
            if r.ready:
                if limit and d - r.since > limit:
                    starving.append((r.head, r))
                if best is None or r.order < best_order:
                    best, best_order = r, r.order
        if es.queue:  # the pipeline's queue (None below)
            head = self.req0[es.queue[0]].key if es.j == 0 else (es.queue[0].head, 0)
            if limit and d - es.since > limit:
                starving.append((head, None))
            if best is None or (_SMALL, head) < best_order:
                best = None
        if starving:  # the oldest head among the queues past the starvation limit
            best = min(starving, key=_first)[1]
        if best is None:
            self._serve_pipe(es, x)
        else:
            self._serve_replica(es, best, x, last)
        if starving:  # (counted once served: a decision the replay cannot apply is not its own)
            es.promotions += 1
        self.decided += 1

    @staticmethod
    def _grow(es: _Engine, kvs) -> bool:
        """KV for one more token of each member, in order; False (nothing changed) if it does
        not fit in the free blocks (`schedule` would evict)."""
        need = 0
        for m in kvs:
            target = m[3] + 1
            if target > m[0]:
                need += (-(-target // m[1]) - m[0] // m[1]) * m[2]
        if need:
            if need > es.blocks:
                return False
            es.blocks -= need
            for m in kvs:
                target = m[3] + 1
                if target > m[0]:
                    m[0] = -(-target // m[1]) * m[1]
                    es.grows.append((m[4], target))
        for m in kvs:
            m[3] += 1
        return True

    def _serve_replica(self, es: _Engine, r: _Replica, x: float, last: bool) -> None:
        """Run r's decode batch from x; while r is alone on its engine and nothing can reach the
        engine before its step ends (the next local event comes later, and with `last` no
        other decision at x can add an earlier one), its next decisions are r again: chain
        them here."""
        if r.left < 2 or not self._grow(es, r.kv):
            raise _Stop  # a request's last token, or eviction
        r.ready = False
        es.nready -= 1
        heap = self.heap
        bound = min(heap[0][0], self.horizon) if heap else self.horizon
        alone = last and not es.queue and not es.nready
        fn, n, kv, times, busy = r.fn, r.n, r.kv, r.times, es.busy
        while True:
            end = x + fn(r.csum + n)  # (it may end past the horizon: its end is handed over at the cut)
            es.d += 1
            r.formed += 1
            es.formed += 1
            r.csum += n
            r.left -= 1
            times.append(end)
            busy.append((x, end, n))
            if not (alone and end < bound and r.left >= 2 and self._grow(es, kv)):
                break
            x = end  # the engine decides at this end: r again
            self.decided += 1
        r.since = es.d  # served at decision d, back (non-empty again) before the next
        es.running = (end, r)
        self.push(end, _END, es.j, r)

    def _serve_pipe(self, es: _Engine, x: float) -> None:
        if es.j == 0:  # the waiting requests form one batch (fewer than max_batch_size)
            rids = es.queue
            req0, gen0 = self.req0, self.gen0
            if any(req0[rid].max_new_tokens - gen0[rid] < 2 for rid in rids):
                raise _Stop  # its token would be a request's last
            bid = f"{self.pkey[0]}/e{es.eng.id}/{es.batch_seq + es.formed + 1}"
            b = _Batch(list(rids), [es.pkv[rid][3] for rid in rids], bid, x, min(req0[rid].arrival for rid in rids))
        else:
            b = es.queue[0]
        end = x + es.eng.decode_time_fn(es.info, b.n)(b.csum + b.n)
        if not self._grow(es, [es.pkv[rid] for rid in b.rids]):
            raise _Stop  # it would evict
        if es.j == 0:
            es.queue = []
            es.formed += 1
            for rid in b.rids:
                es.bid_of[rid] = b.bid
        else:
            del es.queue[0]
            if id(b) in es.queued:
                es.served_queued += 1
            for rid in b.rids:
                es.pgen[rid] += 1
        es.since = es.d
        es.d += 1
        es.busy.append((x, end, b.n))
        es.running = (end, b)
        self.push(end, _END, es.j, b)

    # ------------------------------------------------------------------ the cut
    def apply(self) -> None:
        """Apply the replayed decisions in bulk and hand what is still under way to real events."""
        cluster = self.cluster
        metrics = cluster.metrics
        records = cluster.records
        model = self.pkey[0]
        group = self.group
        for es in group:  # take the replaced events off the heap's duty
            for ev in es.messages:
                cluster.take_message(ev)
            ev = es.taken
            batch = es.started
            if ev is not None:
                if not isinstance(ev, ReplayEndEvent) and ev.batch.model != model:
                    batch = ev.batch
                cluster.take_over(es.eng)
            if batch is not None:  # a one-stage batch ran: its tokens are back at once
                s = es.eng.scheduler
                s.receive_tokens(s.complete(batch).token_message)
        for es in group:
            eng = es.eng
            s = eng.scheduler
            metrics.decode_steps(eng.id, es.busy)
            for r in es.replicas:
                if r.formed:
                    s.replay_first_decode(r.key[0], r.rids, r.formed, r.since, False)
                if r.times:
                    metrics.token_steps(r.recs, r.times)
            if es.j == 0:
                members = [(rid, kv[3], self.gen0[rid], es.bid_of.get(rid)) for rid, kv in es.pkv.items()]
                s.replay_pipeline_first(model, members)
            else:
                waiting = {rid for b in es.queue if id(b) in es.queued for rid in b.rids}
                members = [(rid, kv[3], es.pgen[rid]) for rid, kv in es.pkv.items() if rid not in waiting]
                s.replay_pipeline_later(model, es.j, members, es.served_queued)
                for b, d, i in es.arrivals:  # received in the replay, still waiting: received for real
                    if any(b is q for q in es.queue):
                        s.replay_receive(self._message(b, es.j), d, es.seq + i - 1)
            s.replay_grows(es.grows)
            s.replay_counters(es.d, es.seq + es.received, es.formed, es.promotions)
            s.replay_ages(model, es.since, [(r.key[0], r.since) for r in es.replicas])
        for nbytes in self.hops:
            metrics.hop(nbytes)
        for b, time in self.tokens:
            metrics.tokens([records[rid] for rid in b.rids], time)
        # what is under way at the cut
        pkey = self.pkey
        for time, kind, _, j, what in sorted(self.heap):
            es = group[j]
            if kind == _END:
                cluster.hold(es.eng, what if isinstance(what, tuple) else what.key if isinstance(what, _Replica) else pkey,
                             time)
                if isinstance(what, _Batch):
                    if j < self.last:
                        nbytes = CostModel.hidden_bytes(self.arch, what.n)
                        metrics.hop(nbytes)
                        cluster.send_batch(group[j + 1].eng, pkey, self._message(what, j + 1),
                                           time + cluster.interconnect.transfer_time(nbytes))
                    else:
                        metrics.tokens([records[rid] for rid in what.rids], time)
                        cluster.send_tokens(group[0].eng, pkey, self._tokens(what), time + self.back)
            elif kind == _ARRIVE:
                cluster.send_batch(es.eng, pkey, self._message(what, j), time)
            else:
                cluster.send_tokens(es.eng, pkey, self._tokens(what), time)
        for es in self.held:
            cluster.hold(es.eng, pkey, self.cut)
        if cluster.check:
            for es in group:
                es.eng.scheduler.check()

    def _message(self, b: _Batch, stage: int) -> BatchMessage:
        return BatchMessage(self.pkey[0], stage, b.bid, DECODE, [],
                            [DecodeEntry(rid, None, p) for rid, p in zip(b.rids, b.pos)], b.formed_at)

    def _tokens(self, b: _Batch) -> TokenMessage:
        return TokenMessage(self.pkey[0], b.bid, [TokenEntry(rid, None, p + 1, False, None) for rid, p in zip(b.rids, b.pos)])


def _batch_head(b: _Batch) -> float:
    return b.head


def _first(pair):
    return pair[0]
