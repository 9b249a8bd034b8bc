"""The joint replay's start: whether a pipeline's group can be replayed now, and its state.

Place in the data flow: `JointReplay.advance` (joint_replay.py) calls `may_replay` (the quick
refusals) and then `capture`, which checks the conditions listed in joint_replay.py's docstring
engine by engine and builds the start state (joint_state.py) that `GroupSim` (joint_sim.py)
runs from: per engine a `GroupEngine` with the pipeline's queue, KV and running batch, the
one-stage replicas' batches, the events it takes over; the pipeline's batches and messages in
flight as local events. A failed condition raises `NotReplayable` inside; `capture` then
returns None and nothing has changed.
"""

from __future__ import annotations

from typing import NamedTuple

from paraflex.engine.core.messages import DECODE, PREFILL
from paraflex.simulator.core.events import ReplayEndEvent
from paraflex.simulator.fastpath.joint_state import ARRIVE, END, TOKENS, GroupEngine, HeldStage, Joiner, PipeBatch, ReplicaBatch
from paraflex.simulator.fastpath.kv_growth import MemberKV


class NotReplayable(Exception):
    """A condition of the joint replay fails (the group runs step by step)."""


class GroupStart(NamedTuple):
    """The captured start of a replay: the group's engines (route order), the local events
    pending (time, kind, stage, what), each pipeline request's tokens at the first stage."""

    group: list[GroupEngine]
    events: list[tuple]
    gen0: dict[str, int]


def may_replay(first, sb, route, model: str) -> bool:
    """Quick refusals (most attempts): a prefill running on the route that the replay cannot
    take over (`joinable`), or a running one-stage batch (`sb` on `first` included) with a
    request's last token."""
    for eng in route:
        if eng.wake_pending or eng.scheduler.has_swapped:
            return False
        ev = eng.running
        if eng is first or (eng.busy and not isinstance(ev, ReplayEndEvent)):
            b = sb if eng is first else ev.batch
            if b is not None and b.kind == PREFILL and joinable(eng, b, model):
                continue
            if b is None or b.kind != DECODE:
                return False
            if b.model != model:
                req = eng.scheduler.request
                for sr in b.requests:
                    r = req(sr.req_id)
                    if r.max_new_tokens - r.generated < 2:
                        return False
    return True


def joinable(eng, b, model: str) -> bool:
    """A prompt batch running on `eng` that the replay can take over: one whole prompt of a
    one-stage replica (not the pipeline's) moving no KV, whose first token is not its last."""
    info = eng.stages[b.model]
    if b.model == model or not (info.first and info.last) or len(b.requests) != 1 or b.swap_in or b.swap_out:
        return False
    sr = b.requests[0]
    req = eng.scheduler.request(sr.req_id)
    return sr.start_pos == 0 and sr.num_tokens == req.prompt_len and req.max_new_tokens >= 2 and not req.abort_pending


def capture(cluster, first, sb, route, pkey, t: float) -> GroupStart | None:
    """The start state of the group of pipeline replica `pkey` on `route` (its engines), `first`
    having formed `sb` at t (it runs from t); None if a condition fails."""
    try:
        return _Capture(cluster, first, sb, pkey, t).run(route)
    except NotReplayable:
        return None


class _Capture:
    """One capture: the engines one by one, then the conditions on the whole group."""

    def __init__(self, cluster, first, sb, pkey, t: float):
        self.cluster, self.first, self.sb, self.pkey, self.t = cluster, first, sb, pkey, t
        self.model = pkey[0]
        self.counts = cluster.dispatcher.outstanding
        self.events: list[tuple] = []  # (time, kind, stage, what)
        self.batches: list[PipeBatch] = []
        self.coming: list[str] = []  # pipeline requests whose coming token is not yet produced
        self.waiting = 0  # pipeline requests waiting at the first stage
        self.in_tokens = 0  # pipeline requests whose token message is in flight
        self.pipe_events = 0  # events of the pipeline replica the replay takes over

    def run(self, route) -> GroupStart:
        group = [self._engine(j, eng) for j, eng in enumerate(route)]
        model, rho = self.pkey
        n = self.counts(model)[rho]
        if len(self.coming) + self.waiting + self.in_tokens != n or n >= route[0].scheduler.max_batch_size:
            raise NotReplayable
        if len(self.cluster.route_pending[self.pkey]) != self.pipe_events:
            raise NotReplayable
        gen0 = {}
        arrivals = []  # of every request whose arrival can become a queue's head in the replay
        for r in route[0].scheduler.live_requests():
            if r.model == model:
                gen0[r.req_id] = r.generated
                arrivals.append(r.arrival)
        for es in group:
            jn = es.joiner
            for r in es.replicas:  # (ties inside one replica's batch order nothing)
                own = {k[0] for k in r.keys}
                if jn is not None and jn.key == r.key:
                    own.add(jn.req_key[0])
                arrivals.extend(own)
        if len(set(arrivals)) != len(arrivals):  # equal arrival times: an order could depend on sequence numbers
            raise NotReplayable
        e0 = group[0]
        for b in self.batches:
            for rid in b.rids:
                e0.bid_of[rid] = b.bid
        return GroupStart(group, self.events, gen0)

    def _engine(self, j: int, eng) -> GroupEngine:
        s = eng.scheduler
        if s.has_swapped or eng.wake_pending:
            raise NotReplayable
        es = GroupEngine(eng, j, eng.stages[self.model], 0 if s.order.starvation_limit == 0 else s.effective_starvation_limit)
        pst = s.stage_of(self.model)
        if pst.prefill_q.items or (j and pst.full_q.items):
            raise NotReplayable
        self._pipeline_queue(es, pst)
        expected: list[float] = []  # times of the events pending here that the replay takes over
        running, start, end = self._running(es, expected)
        if running is not None and running.model == self.model:
            self._pipeline_running(es, running, start, end)
            running = None
        elif running is not None:
            info = eng.stages[running.model]
            if not (info.first and info.last):
                raise NotReplayable
        self._pipeline_messages(es, expected)
        if sorted(eng.pending) != sorted(expected):
            raise NotReplayable
        for r in s.live_requests():
            if r.model == self.model:
                es.pkv[r.req_id] = MemberKV(r.alloc, r.context_len)
                es.pgen[r.req_id] = r.generated
        if isinstance(es.running, PipeBatch):  # the pipeline's, running: its step is done
            for rid in es.running.rids:
                es.pkv[rid].context += 1
                es.pgen[rid] += 1
        self._replicas(es, running, start, end)
        if es.running is None and (es.queue or es.nready):  # idle with work waiting (for KV)
            raise NotReplayable
        return es

    def _pipeline_queue(self, es: GroupEngine, pst) -> None:
        """The pipeline's waiting work here: received decode batches (a later stage) or
        requests whose token is back (the first stage)."""
        s = es.eng.scheduler
        if es.j:
            for pb in pst.decode_q.items:  # received batches waiting here
                if pb.prefills or pb.dropped:
                    raise NotReplayable
                b = batch_of(pb.msg, s)
                es.queue.append(b)
                self.batches.append(b)
                self.coming.extend(b.rids)
            es.queued = set(map(id, es.queue))
        else:
            es.queue = [r.req_id for r in pst.decode_q.items]  # tokens back, waiting for a batch
            self.waiting = len(es.queue)
        if es.queue:
            es.since = pst.decode_q.since

    def _running(self, es: GroupEngine, expected: list[float]):
        """What runs on the engine: (a decode batch, its start, its end or None if it starts
        now), or (None, 0, None) when nothing or a stage the replay takes over as such runs (a
        stage an earlier replay held, a one-stage prompt that joins its batch at its end)."""
        eng = es.eng
        if eng is self.first:
            return self.sb, self.t, None
        if not eng.busy:
            return None, 0.0, None
        ev = eng.running
        if isinstance(ev, ReplayEndEvent):  # held by an earlier replay until its stage ends
            if ev.finished:  # requests finish at its end (their token message is under way too)
                raise NotReplayable
            held = HeldStage(ev.key)
            self._take(es, ev, expected, held)
            self.pipe_events += ev.key == self.pkey
            return None, 0.0, None
        if ev is None or ev.batch is None:
            raise NotReplayable
        if ev.batch.kind == PREFILL and joinable(eng, ev.batch, self.model) and self.cluster.local_tokens_direct:
            rid = ev.batch.requests[0].req_id
            es.joiner = Joiner((ev.batch.model, eng.stages[ev.batch.model].replica), ev, eng.scheduler.request(rid),
                               self.cluster.records[rid])
            self._take(es, ev, expected, es.joiner)
            return None, 0.0, None
        running = ev.batch
        if running.kind != DECODE or running.swap_in or running.swap_out:
            raise NotReplayable
        expected.append(ev.time)
        es.taken = ev
        self.pipe_events += running.model == self.model
        return running, ev.start, ev.time

    def _take(self, es: GroupEngine, ev, expected: list[float], what) -> None:
        """The replay takes over `ev`, the end of `what` running on the engine."""
        expected.append(ev.time)
        es.taken = ev
        es.running = what
        self.events.append((ev.time, END, es.j, what))

    def _pipeline_running(self, es: GroupEngine, running, start: float, end: float | None) -> None:
        """A batch of the pipeline runs on the engine (formed at the first stage, received at a
        later one)."""
        s = es.eng.scheduler
        rids = [sr.req_id for sr in running.requests]
        if es.j == 0:
            formed_at = running.formed_at if end is None else running.message.formed_at
        else:
            formed_at = running.message.formed_at if running.message else 0.0
        b = PipeBatch(rids, [sr.start_pos for sr in running.requests], running.batch_id, formed_at,
                      min(s.request(rid).arrival for rid in rids))
        if end is None:
            end = self.t + es.eng.decode_time_fn(es.info, b.n)(b.csum + b.n)
        self.batches.append(b)
        self.coming.extend(rids)
        es.running = b
        es.busy.append((start, end, b.n))
        self.events.append((end, END, es.j, b))

    def _pipeline_messages(self, es: GroupEngine, expected: list[float]) -> None:
        """The pipeline's messages in flight to the engine: decode batches to a later stage,
        tokens (none a last one) to the first."""
        s = es.eng.scheduler
        for ev in self.cluster.messages[self.pkey]:
            if ev.engine is not es.eng:
                continue
            msg = ev.message
            if es.j:
                if msg.prefills:
                    raise NotReplayable
                b = batch_of(msg, s)
                self.events.append((ev.time, ARRIVE, es.j, b))
                self.coming.extend(b.rids)
            else:
                if any(e.finished for e in msg.entries):
                    raise NotReplayable
                b = PipeBatch([e.req_id for e in msg.entries], [e.position - 1 for e in msg.entries], msg.batch_id,
                              0.0, min(s.request(e.req_id).arrival for e in msg.entries))
                self.events.append((ev.time, TOKENS, 0, b))
                self.in_tokens += b.n
            self.batches.append(b)
            expected.append(ev.time)
            es.messages.append(ev)
            self.pipe_events += 1

    def _replicas(self, es: GroupEngine, running, start: float, end: float | None) -> None:
        """Every other stage on the engine: a one-stage replica whose unfinished requests are
        all in one decode batch, running (`running`) or waiting in its decode queue, except
        the request whose prompt runs here (`es.joiner`)."""
        eng, s = es.eng, es.eng.scheduler
        max_batch = s.max_batch_size
        decode_class = s.policy.class_of
        records = self.cluster.records
        for m, rinfo in eng.stages.items():
            if m == self.model:
                continue
            if not (rinfo.first and rinfo.last):
                raise NotReplayable
            st = s.stage_of(m)
            if st.prefill_q.items:
                raise NotReplayable
            key = (m, rinfo.replica)
            nr = self.counts(m)[rinfo.replica]
            if es.joiner is not None and es.joiner.key == key:  # its prompt runs here: the others wait, if any
                if nr > max_batch:
                    raise NotReplayable
                nr -= 1
                if not nr:
                    es.replicas.append(ReplicaBatch(key, [], decode_class("decode", True, 0, max_batch), None, [], rinfo))
                    continue
            q = st.decode_q
            runs_here = running is not None and running.model == m
            if runs_here:
                if q.items or len(running.requests) != nr:
                    raise NotReplayable
                reqs = [s.request(sr.req_id) for sr in running.requests]
            elif nr:
                if len(q.items) != nr:
                    raise NotReplayable
                reqs = list(q.items)
            else:
                continue
            if nr > max_batch:
                raise NotReplayable
            r = ReplicaBatch(key, reqs, decode_class("decode", True, nr, max_batch), eng.decode_time_fn(rinfo, nr),
                             [records[x.req_id] for x in reqs], rinfo)
            if runs_here:  # its step ends, its tokens come back
                if r.left < 2:
                    raise NotReplayable
                if end is None:
                    end = self.t + r.fn(r.csum + r.n)
                for kv in r.kv:
                    kv.context += 1
                r.csum += r.n
                r.left -= 1
                r.times.append(end)
                r.since = es.d
                es.running = r
                es.started = running if eng is self.first else None
                es.busy.append((start, end, r.n))
                self.events.append((end, END, es.j, r))
            else:
                r.ready = True
                es.nready += 1
                r.since = q.since
            es.replicas.append(r)


def batch_of(msg, s) -> PipeBatch:
    """A received decode batch message of the pipeline as a `PipeBatch` (scheduler `s`'s requests)."""
    return PipeBatch([e.req_id for e in msg.decodes], [e.position for e in msg.decodes], msg.batch_id, msg.formed_at,
                     min(s.request(e.req_id).arrival for e in msg.decodes))
