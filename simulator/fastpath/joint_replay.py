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

- the policy is `full-batch-first` without the in-flight bound (`scheduler.decode_batches_in_flight:
  unbounded`, the paper's rule: the replay forms a batch whenever the first stage picks its
  queue); every unfinished request of the pipeline replica is in a
  decode batch (fewer than `max_batch_size` in all): the one just formed, or one running at a
  later stage, queued there, or in flight as a batch or token message; no engine of the group
  holds swapped KV;
- every other stage on the group's engines is a one-stage replica whose unfinished requests
  (at most `max_batch_size`) are all in one decode batch, running or waiting in its decode
  queue, except one whose prompt runs on that engine (a whole prompt, its first token not its
  last: at its end the request joins the batch, `GroupSim._join`); so every route touching
  the group lies inside it, and only new requests can reach it from outside; the events
  pending at the group are those batches' and prompts' ends and the pipeline's;
- no two of the group's requests tie in arrival time, except members of one replica's batch
  (a queue's head, now or after a finish or a join, is one of them; tied keys would order by
  sequence numbers the replay does not model);

every decision of the group is a function of the times, and the replay computes them with a
small event simulation of the group: an engine that becomes free, or receives work while idle,
decides after everything at that instant (as the event loop delivers) and picks what
`schedule` picks: a queue not served for more than the starvation limit first (oldest head),
else the least (policy class, head key); at the first stage the pipeline's waiting requests
form one batch; a later stage runs its oldest received batch. Stage times, hops and token
times are the event handlers' float expressions. It goes on while each decision is one it can
apply in bulk (KV growth within free blocks) up to the horizon: the first new request the
dispatcher may send into the group (`_skip_arrivals`).

Last tokens are replayed. A one-stage step's finished members leave its batch at its end (their
KV freed, in order with the growth; the others go on as a smaller batch); a pipeline request's
last token frees its KV on the later stages at the last stage's end and on the first when the
token is back there (as `Cluster._emit_tokens` and `receive_tokens` free it). Either way the
replay pauses after that instant's events; a `ReplayFinishEvent` at that instant, before any
new request there, finishes them outside the group (records, the dispatcher's counts:
`finished`), and the replay goes on with a horizon computed from the new counts.

At the horizon the replay waits with its state intact (`arrival`; the engines stay busy, the
events it took over do nothing): when that request is dispatched (`Cluster.admit`), the replay
goes on to its next horizon if the request went to a replica outside the group (the counts it
saw are the step-by-step ones: the finishes before it were applied at their time). If it came
into the group, to a one-stage replica whose requests then still fit one batch, on an engine
with no other prompt in the replay (`_admissible`), the replay admits it (`GroupSim.admit`):
it waits in that engine's prefill queue (full-batch-first's class between full and other
decode batches), its prompt is formed when chosen and admitted above the KV watermark
(`_serve_prompt`; not admitted: cut) and at its end it joins its replica's batch (possibly
after the batch's first steps: `ReplicaBatch.late`); the cut adds it to the scheduler as at
its arrival and forms its prompt as at its formation (`replay_admit`, `replay_form_prefill`).
Otherwise the replay is cut at that instant, after the group's events there and before the
request joins.

The cut, at the first instant it cannot replay: everything before is applied in bulk (per
engine the metrics in time order, the requests' states, queues and their ages, the KV growth in
decision order, the decision, message and batch counters; `EngineScheduler.replay_*`); what is
running then ends with a `ReplayEndEvent` (its effects applied, the engine decides for real
at its end; a pipeline's last stage with last tokens finishes those requests then:
`Cluster.replay_done`), except a one-stage step with last tokens, which is formed for real at
its start (`replay_form`) and ends with its `StageEndEvent`; a prompt taken over is completed (first
token, request in its decode queue: `replay_prefill_done`), its engine held until its end if
it still runs; messages still in flight become real `BatchArrivalEvent`s / `TokenArrivalEvent`s.
The simulation lives in joint_sim.py, the cut in joint_cut.py, the state they move in joint_state.py. Exactness is pinned by
tests/simulator/test_sim_joint_replay.py (whole runs identical to step by step).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from paraflex.engine.core.messages import DECODE, PREFILL
from paraflex.simulator.core.events import ReplayEndEvent, ReplayFinishEvent
from paraflex.simulator.fastpath.joint_sim import GroupSim
from paraflex.simulator.fastpath.joint_state import (ARRIVE, END, FULL, SMALL, TOKENS, Admitted, GroupEngine, Joiner, PipeBatch,
                                            ReplicaBatch, kv_of)

INF = float("inf")


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
        self.suspended: list[GroupSim] = []  # replays waiting at their horizon (`arrival`)
        self.until = 0.0  # the last instant a replay processed (the run's last event may be one it replayed)

    # ------------------------------------------------------------------ entry
    def advance(self, eng, sb, t: float) -> bool:
        """Replay the group of the pipeline on `eng` from `sb` (the decode batch `eng` formed
        at t) on; True if it did (the engines then run on from the cut), False if nothing
        changed."""
        cluster = self.cluster
        pkey = self.pipe_of[eng.id]
        if (pkey is None or sb.kind != DECODE or sb.swap_in or sb.swap_out
                or eng.scheduler.policy.name != "full-batch-first" or eng.scheduler.decode_inflight_limit is not None
                or not cluster.dispatcher.outstanding(pkey[0])[pkey[1]]):
            return False
        route = [cluster.engines[e] for e in cluster.replicas[pkey[0]][pkey[1]]]
        if not self._may_replay(eng, sb, route, pkey[0]):
            return False
        state = self._state(eng, sb, route, pkey, t)
        if state is None:
            return False
        group, events, gen0 = state
        bounds = self._bounds(route, group)
        sim = GroupSim(self.cluster, group, pkey, gen0, bounds, self._horizon(bounds, t))
        for ev in events:
            sim.push(*ev)
        sim.run()
        if not sim.decided:
            return False
        sim.take()
        self._settle(sim)
        return True

    def _settle(self, sim: GroupSim) -> None:
        """After `sim.run`: wait for the main loop at last tokens (`finished`) or at the
        horizon (`arrival`), else cut."""
        if sim.cut is None and sim.paused is not None:
            sim.suspend()
            if sim.finishing:
                self.cluster.loop.schedule(ReplayFinishEvent(sim.paused[0], sim))
            else:
                self.suspended.append(sim)
        else:
            sim.apply()
            self.decisions += sim.decided
            self.until = max(self.until, sim.now)

    def arrival(self, req, replica: int, route, t: float) -> bool:
        """New request `req` (a `SimRequest`) is dispatched at t to `replica`, on `route` (engine
        ids): a replay waiting at t for a request of its models goes on to its next horizon if
        this one goes elsewhere (and no other new request of its models comes at t); if it comes
        into the group, the replay admits it (`_admissible`: True, the replay adds it to its
        engine at the cut) or is cut at t, before the request joins. A request of a model not
        resident on the group (its route lies outside) leaves the replay waiting for its own. (A
        replay never waits past a request that may come into its group, so only those waiting at
        t are concerned.)"""
        admitted = False
        for sim in self.suspended[:]:
            if sim.paused[0] != t or req.model not in sim.bounds[0]:
                continue
            self.suspended.remove(sim)
            models, seen, _ = sim.bounds
            cut = self._arrivals_at(models, t) != 1
            if not cut and not seen.isdisjoint(route):
                es = self._admissible(sim, req, replica, route)
                if es is None:
                    cut = True
                else:
                    st = es.eng.scheduler.stage_of(req.model)
                    sim.admit(es, Admitted((req.model, replica), str(req.id), req.prompt_len, req.output_len, t,
                                           self.cluster.records[str(req.id)], es.eng.stages[req.model], st,
                                           es.d, es.seq + es.received + 1))
                    admitted = True
            self._go_on(sim, t, cut)
        return admitted

    @staticmethod
    def _admissible(sim: GroupSim, req, replica: int, route):
        """The group engine whose replay admits `req` (dispatched to `replica` on `route`), or
        None: a one-stage replica (not the pipeline) whose requests, this one included, fit one
        batch, on an engine where no other admitted prompt waits, and a request of at least two
        tokens that the engine can hold (else `add_request` refuses it, at its time)."""
        if len(route) != 1 or req.model == sim.pkey[0] or req.output_len < 2:
            return None
        es = next((es for es in sim.group if es.eng.id == route[0]), None)
        if es is None or es.admitted is not None:
            return None
        s = es.eng.scheduler
        if sim.cluster.dispatcher.outstanding(req.model)[replica] > s.max_batch_size:
            return None  # (counted already) its replica's requests would not fit one batch
        st = s.stage_of(req.model)
        if -(-(req.prompt_len + req.output_len - 1) // st.tokens_per_block) * st.num_layers > es.eng.pool.capacity:
            return None
        return es

    def finished(self, sim: GroupSim, t: float) -> None:
        """The replay's last tokens at t (`ReplayFinishEvent`, before any new request at t):
        the requests finish as `Cluster._emit_tokens` finishes them (records, dispatcher);
        the replay goes on with the dispatcher's new counts, or is cut at t if a new request
        of the group's models comes at t."""
        cluster = self.cluster
        records, metrics, done = cluster.records, cluster.metrics, cluster.dispatcher.done
        for (model, rho), rids in sim.finishing:
            for rid in rids:
                metrics.finish(records.pop(rid), t)
                done(model, rho)
        sim.finishing = []
        self._go_on(sim, t, cut=self._arrivals_at(sim.bounds[0], t) > 0)

    def _go_on(self, sim: GroupSim, t: float, cut: bool) -> None:
        """A replay paused at t: cut there, or run on to its next horizon; then settle it."""
        if cut:
            sim.cut_paused()
        else:
            sim.horizon = self._horizon(sim.bounds, t)
            sim.run()
        self._settle(sim)

    @staticmethod
    def _may_replay(first, sb, route, model: str) -> bool:
        """Quick refusals (most attempts): a prefill running on the route that the replay
        cannot take over (`_joinable`), or a running one-stage batch (`sb` on `first`
        included) with a request's last token."""
        for eng in route:
            if eng.wake_pending or eng.scheduler.has_swapped:
                return False
            ev = eng.running
            if eng is first or (eng.busy and not isinstance(ev, ReplayEndEvent)):
                b = sb if eng is first else ev.batch
                if b is not None and b.kind == PREFILL and _joinable(eng, b, model):
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
            es = GroupEngine(eng, j, info, 0 if s.order.starvation_limit == 0 else s.effective_starvation_limit)
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
                    if ev.finished:
                        return None  # requests finish at its end (their token message is under way too)
                    expected.append(ev.time)
                    es.taken = ev
                    es.running = (ev.time, ev.key)
                    events.append((ev.time, END, j, ev.key))
                    pipe_events += ev.key == pkey
                elif ev is None or ev.batch is None:
                    return None
                elif ev.batch.kind == PREFILL and _joinable(eng, ev.batch, model) and cluster.local_tokens_direct:
                    rid = ev.batch.requests[0].req_id
                    jn = es.joiner = Joiner((ev.batch.model, eng.stages[ev.batch.model].replica), ev, s.request(rid),
                                            records[rid])
                    expected.append(ev.time)
                    es.taken = ev
                    es.running = (ev.time, jn)
                    events.append((ev.time, END, j, jn))
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
                    b = PipeBatch(rids, [sr.start_pos for sr in running.requests], running.batch_id,
                               running.formed_at if end_ev is None else running.message.formed_at,
                               min(s.request(rid).arrival for rid in rids))
                else:
                    b = PipeBatch(rids, [sr.start_pos for sr in running.requests], running.batch_id,
                               running.message.formed_at if running.message else 0.0,
                               min(s.request(rid).arrival for rid in rids))
                if end_ev is None:
                    end_ev = t + eng.decode_time_fn(info, b.n)(b.csum + b.n)
                batches.append(b)
                coming.extend(rids)
                es.running = (end_ev, b)
                es.busy.append((start, end_ev, b.n))
                events.append((end_ev, END, j, b))
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
                    events.append((ev.time, ARRIVE, j, b))
                    coming.extend(b.rids)
                else:
                    if any(e.finished for e in msg.entries):
                        return None
                    b = PipeBatch([e.req_id for e in msg.entries], [e.position - 1 for e in msg.entries], msg.batch_id,
                               0.0, min(s.request(e.req_id).arrival for e in msg.entries))
                    events.append((ev.time, TOKENS, 0, b))
                    in_tokens += b.n
                batches.append(b)
                expected.append(ev.time)
                es.messages.append(ev)
                pipe_events += 1
            if sorted(eng.pending) != sorted(expected):
                return None
            for r in s.live_requests():
                if r.model == model:
                    es.pkv[r.req_id] = kv_of(r)
                    es.pgen[r.req_id] = r.generated
            if es.running is not None and isinstance(es.running[1], PipeBatch):  # the pipeline's, running: its step is done
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
                joining = es.joiner is not None and es.joiner.key == (m, rinfo.replica)
                if joining:  # its prompt runs here: the others wait in the decode queue, if any
                    if nr > max_batch:
                        return None
                    nr -= 1
                    if not nr:
                        es.replicas.append(ReplicaBatch((m, rinfo.replica), [], SMALL, None, [], rinfo))
                        continue
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
                r = ReplicaBatch((m, rinfo.replica), reqs, FULL if nr >= max_batch else SMALL,
                             eng.decode_time_fn(rinfo, nr), [records[x.req_id] for x in reqs], rinfo)
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
                    events.append((end_ev, END, j, r))
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
        s0 = route[0].scheduler
        gen0 = {}
        arrivals = []  # of every request whose arrival can become a queue's head in the replay
        for r in s0.live_requests():
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
        if len(set(arrivals)) != len(arrivals):
            return None  # equal arrival times: an order could depend on sequence numbers
        e0 = group[0]
        for b in batches:
            for rid in b.rids:
                e0.bid_of[rid] = b.bid
        return group, events, gen0

    def _batch_of(self, msg, s) -> PipeBatch:
        return PipeBatch([e.req_id for e in msg.decodes], [e.position for e in msg.decodes], msg.batch_id, msg.formed_at,
                      min(s.request(e.req_id).arrival for e in msg.decodes))

    @staticmethod
    def _bounds(route, group: list[GroupEngine]):
        """(models resident on the group, its engine ids, its replicas): what bounds its
        horizon, the first new request the dispatcher may send into the group (every route
        touching the group lies inside it, so nothing else can reach it; the group's replicas
        keep their counts until a finish inside the replay, after which `finished` computes the
        horizon again)."""
        frozen = {r.key for es in group for r in es.replicas}
        frozen.add((group[0].info.model, group[0].info.replica))
        models = {m for es in group for m in es.eng.stages}
        return models, {eng.id for eng in route}, frozen

    def _horizon(self, bounds, t: float) -> float:
        """The first new request after t the dispatcher may send into the group of `bounds`."""
        models, seen, frozen = bounds
        return self.ff.arrival_horizon(models, t, INF, seen, frozen)

    def _arrivals_at(self, models, t: float) -> int:
        """How many new requests of `models` come at t."""
        n = 0
        for m in models:
            ts = self.ff.arrivals.get(m)
            if ts:
                n += bisect_right(ts, t) - bisect_left(ts, t)
        return n


def _joinable(eng, b, model: str) -> bool:
    """A prompt batch running on `eng` that the replay can take over: one whole prompt of a
    one-stage replica (not the pipeline's) moving no KV, whose first token is not its last."""
    info = eng.stages[b.model]
    if b.model == model or not (info.first and info.last) or len(b.requests) != 1 or b.swap_in or b.swap_out:
        return False
    sr = b.requests[0]
    req = eng.scheduler.request(sr.req_id)
    return sr.start_pos == 0 and sr.num_tokens == req.prompt_len and req.max_new_tokens >= 2 and not req.abort_pending
