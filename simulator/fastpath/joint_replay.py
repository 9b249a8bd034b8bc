"""Joint replay: a pipeline's decode batches and the one-stage batches on its engines, in closed form.

Place in the data flow: the fast path's hook (hook.py) offers it every decode batch an engine of
a multi-stage replica forms, when the engines' policy names `ExactReplay.pipeline_group`
(engine/core/policies/base.py), before the decode fast-forward (fast_forward.py), whose own
pipeline replay refuses such batches because other work shares the route's engines. In the base case llama-2-70b's 3-stage pipeline sits on engines
{0, 1, 2} and {3, 4, 5}, each also holding one-stage replicas of other models: the engines
alternate between the pipeline's batches (often several in flight, one per group of requests
that joined at different times) and those replicas' decode steps, so no batch can be replayed
alone, and step by step every pipeline cycle costs 6 events plus those of the steps between.

The group is the pipeline's route. When (checked at the moment its first engine formed the
batch, at time t):

- the first stage has no in-flight bound (`scheduler.decode_batches_in_flight: unbounded`, the
  paper's rule: the replay forms a batch whenever the first stage picks its queue); every
  unfinished request of the pipeline replica is in a
  decode batch (fewer than `max_batch_size` in all): the one just formed, or one running at a
  later stage, queued there, or in flight as a batch or token message; no engine of the group
  holds swapped KV;
- every other stage on the group's engines is a one-stage replica whose unfinished requests
  (at most `max_batch_size`) are all in one decode batch, running or waiting in its decode
  queue, except one whose prompt runs on that engine (a whole prompt, its first token not its
  last: at its end the request joins the batch, `GroupSim.join`); so every route touching
  the group lies inside it, and only new requests can reach it from outside; the events
  pending at the group are those batches' and prompts' ends and the pipeline's;
- no two of the group's requests tie in arrival time, except members of one replica's batch
  (a queue's head, now or after a finish or a join, is one of them; tied keys would order by
  sequence numbers the replay does not model);

every decision of the group is a function of the times, and the replay computes them with a
small event simulation of the group: an engine that becomes free, or receives work while idle,
decides after everything at that instant (as the event loop delivers) and picks what
`schedule` picks (joint_decide.py): a queue not served for more than the starvation limit first
(oldest head), else the least (policy class, head key), each queue's class from the policy's
own `class_of`; at the first stage the pipeline's waiting requests form one batch; a later
stage runs its oldest received batch. Stage times, hops and token
times are the event handlers' float expressions. It goes on while each decision is one it can
apply in bulk (KV growth within free blocks) up to the horizon: the first new request the
dispatcher may send into the group (`DecodeFastForward.arrival_horizon`).

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
it waits in that engine's prefill queue (in the policy's class of a prefill queue), its prompt
is formed when chosen and admitted above the KV watermark (`GroupDecisions.serve_prompt`; not
admitted: cut) and at its end it joins its replica's batch (possibly after the batch's first
steps: `ReplicaBatch.late`); the cut adds it to the scheduler as at its arrival and forms its
prompt as at its formation (`add_request`, `BulkAdvance.replay_form_prefill`).
Otherwise the replay is cut at that instant, after the group's events there and before the
request joins.

The cut, at the first instant it cannot replay: everything before is applied in bulk (per
engine the metrics in time order, the requests' states, queues and their ages, the KV growth in
decision order, the decision, message and batch counters; `BulkAdvance.replay_*`); what is
running then ends with a `ReplayEndEvent` (its effects applied, the engine decides for real
at its end; a pipeline's last stage with last tokens finishes those requests then:
`Cluster.replay_done`), except a one-stage step with last tokens, which is formed for real at
its start (`replay_form`) and ends with its `StageEndEvent`; a prompt taken over is completed (first
token, request in its decode queue: `complete` and `receive_tokens`), its engine held until its
end if it still runs; messages still in flight become real `BatchArrivalEvent`s /
`TokenArrivalEvent`s. The conditions are checked in joint_capture.py, the simulation lives in
joint_sim.py (its decisions in joint_decide.py), the cut in joint_cut.py, the state they move in
joint_state.py. Exactness is pinned by tests/simulator/test_sim_joint_replay.py (whole runs
identical to step by step).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from paraflex.simulator.core.events import ReplayFinishEvent
from paraflex.simulator.fastpath.joint_capture import capture, may_replay
from paraflex.simulator.fastpath.joint_sim import GroupBounds, GroupSim
from paraflex.simulator.fastpath.joint_state import Admitted, GroupEngine

INF = float("inf")


class JointReplay:
    """The joint replay of one simulated cluster (see the module docstring)."""

    def __init__(self, ff):
        """`ff`: the cluster's `DecodeFastForward` (arrivals, `arrival_horizon`)."""
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
        """Replay the group of the pipeline on `eng` from `sb` (a decode batch moving no KV
        that `eng` formed at t) on; True if it did (the engines then run on from the cut),
        False if nothing changed."""
        cluster = self.cluster
        pkey = self.pipe_of[eng.id]
        if (pkey is None or eng.scheduler.decode_inflight_limit is not None
                or not cluster.dispatcher.outstanding(pkey[0])[pkey[1]]):
            return False
        route = [cluster.engines[e] for e in cluster.replicas[pkey[0]][pkey[1]]]
        if not may_replay(eng, sb, route, pkey[0]):
            return False
        start = capture(cluster, eng, sb, route, pkey, t)
        if start is None:
            return False
        bounds = self._bounds(route, start.group)
        sim = GroupSim(cluster, self.ff.arrivals, start.group, pkey, start.gen0, bounds, self._horizon(bounds, t))
        for ev in start.events:
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
                self.cluster.loop.schedule(ReplayFinishEvent(sim.paused.instant, self, sim))
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
            if sim.paused.instant != t or req.model not in sim.bounds.models:
                continue
            self.suspended.remove(sim)
            cut = self._arrivals_at(sim.bounds.models, t) != 1
            if not cut and not sim.bounds.engines.isdisjoint(route):
                es = self._admissible(sim, req, replica, route)
                if es is None:
                    cut = True
                else:
                    st = es.eng.scheduler.stage_of(req.model)
                    sim.admit(es, Admitted((req.model, replica), str(req.id), req.prompt_len, req.output_len, t,
                                           self.cluster.records[str(req.id)], es.eng.stages[req.model], st,
                                           es.d, es.seq + es.received + 1, sim.decisions.prefill_class()))
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
        self._go_on(sim, t, cut=self._arrivals_at(sim.bounds.models, t) > 0)

    def _go_on(self, sim: GroupSim, t: float, cut: bool) -> None:
        """A replay paused at t: cut there, or run on to its next horizon; then settle it."""
        if cut:
            sim.cut_paused()
        else:
            sim.horizon = self._horizon(sim.bounds, t)
            sim.run()
        self._settle(sim)

    @staticmethod
    def _bounds(route, group: list[GroupEngine]) -> GroupBounds:
        """What bounds the group's horizon, the first new request the dispatcher may send into
        it: its models, engines and replicas (every route touching the group lies inside it,
        so nothing else can reach it; the group's replicas keep their counts until a finish
        inside the replay, after which `finished` computes the horizon again)."""
        frozen = {r.key for es in group for r in es.replicas}
        frozen.add((group[0].info.model, group[0].info.replica))
        models = {m for es in group for m in es.eng.stages}
        return GroupBounds(models, {eng.id for eng in route}, frozen)

    def _horizon(self, bounds: GroupBounds, t: float) -> float:
        """The first new request after t the dispatcher may send into the group of `bounds`."""
        return self.ff.arrival_horizon(bounds.models, t, INF, bounds.engines, bounds.frozen)

    def _arrivals_at(self, models, t: float) -> int:
        """How many new requests of `models` come at t."""
        n = 0
        for m in models:
            ts = self.ff.arrivals.get(m)
            if ts:
                n += bisect_right(ts, t) - bisect_left(ts, t)
        return n

