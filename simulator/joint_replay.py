"""Joint replay: a pipeline's decode cycles and the one-stage batches between them, in closed form.

Place in the data flow: `DecodeFastForward.advance` (fast_forward.py) offers it a multi-stage
replica's first-stage decode batch that its own pipeline replay refuses because other work
shares the route's engines. In the base case llama-2-70b's 3-stage pipeline sits on engines
{0, 1, 2} and {3, 4, 5}, each also holding one-stage replicas of other models: the engines
alternate between the pipeline's stage and those replicas' decode steps, so neither kind of
batch can be replayed alone, and step by step each pipeline cycle costs 6 events plus those of
the one-stage steps between its visits.

The group is the pipeline's route. When (checked at the moment its first engine formed the
batch, at time t):

- the policy is `full-batch-first`; the batch holds every unfinished request of its replica
  and nothing else of it is in flight or queued; no engine of the group holds swapped KV;
- every other stage on the group's engines is a one-stage replica whose unfinished requests
  (at most `max_batch_size`) are all in one decode batch, running or waiting in its decode
  queue (so every route touching the group lies inside it, and only new requests can reach it
  from outside); the only events pending at the group are the stage ends of such running
  batches (the replay takes them over: `Cluster.take_over`); no other queue holds work;
- on each engine the queues' head keys differ in arrival time (their order cannot change);

then every decision of the group is a function of the times: an engine that becomes free at
time x picks, among the batches ready at x (a one-stage batch is ready again when its step
ends, the pipeline's when its input arrives: after everything at an instant, as the event loop
delivers), the one `schedule` picks: a queue not served for more than the starvation limit
first (oldest head), else the least (policy class, head key). The replay computes these
decisions cycle by cycle of the pipeline (its stage on each engine, the hops, its tokens back
at the first engine; the one-stage steps in between) with the same float expressions as the
event handlers, and keeps a cycle only if every event of it comes strictly before the horizon
(the first new request that the dispatcher may send into the group, `_skip_arrivals`), no
decision produces a request's last token, and all KV growth fits in free blocks.

It stops at a clean cut after k >= 1 whole cycles: the first engine decides next (for real,
in `Cluster.wakeup`) when the k-th cycle's tokens are back and it is free; every later stage
decides (for real) when its k-th pipeline stage ends (`ReplayEndEvent`). Everything before is
applied in bulk: per engine the metrics in time order, the members' states
(`EngineScheduler.replay_first_decode` / `replay_later_decode`), the KV growth in decision
order (`replay_grows`; block ids as one by one) and the decision, message and batch counters
and queue ages (`replay_counters`, and each queue's `since` as one by one). Exactness is
pinned by tests/test_sim_joint_replay.py (whole runs identical with and without the fast paths).
"""

from __future__ import annotations

from bisect import bisect_right

from paraflex.costmodel import CostModel
from paraflex.engine.messages import DECODE

_FULL, _SMALL = 0, 2  # full-batch-first's classes of decode queues


class _Stop(Exception):
    """A cycle cannot be replayed (horizon, last token, KV): keep the cycles before it."""


class _Stream:
    """One batch that comes back to one engine during the replay: a one-stage replica's decode
    batch, or the pipeline's stage there."""

    __slots__ = ("key", "rids", "recs", "cls", "head", "since", "ready", "csum", "n", "fn", "left", "kv",
                 "first", "formed", "times", "pipe")

    def __init__(self, key, reqs, cls, head, fn, first: bool, pipe: bool, recs):
        self.key = key
        self.rids = [r.req_id for r in reqs]
        self.recs = recs
        self.cls = cls
        self.head = head
        self.since = 0
        self.ready = False
        self.n = len(reqs)
        self.csum = sum(r.context_len for r in reqs)
        self.fn = fn
        self.left = min(r.max_new_tokens - r.generated for r in reqs)  # steps before a last token, + 1
        # per member: [token capacity, tokens per block, layers, context, allocation]
        self.kv = [[r.alloc.blocks_per_layer * r.alloc.tokens_per_block, r.alloc.tokens_per_block,
                    r.alloc.num_layers, r.context_len, r.alloc] for r in reqs]
        self.first = first  # a first stage (forming a batch counts a batch id)
        self.formed = 0  # batches formed by replayed decisions
        self.times: list[float] = []  # one-stage: its token times
        self.pipe = pipe

    def save(self):
        return (self.since, self.ready, self.csum, self.left, [m[:4] for m in self.kv], self.formed, len(self.times))

    def restore(self, s) -> None:
        self.since, self.ready, self.csum, self.left, kv, self.formed, nt = s
        for m, old in zip(self.kv, kv):
            m[:4] = old
        del self.times[nt:]


class _Engine:
    """One engine of the group during the replay: its decision count, when it is next free, its
    free KV blocks, its batches, and what the replay did there (in time order)."""

    __slots__ = ("eng", "d", "free", "blocks", "streams", "pipe", "grows", "busy", "received", "promotions",
                 "limit", "taken")

    def __init__(self, eng, limit: int):
        self.eng = eng
        self.d = eng.scheduler.decisions
        self.free = 0.0
        self.blocks = eng.pool.num_free
        self.streams: list[_Stream] = []
        self.pipe: _Stream | None = None
        self.grows: list = []
        self.busy: list[tuple[float, float, int]] = []
        self.received = 0
        self.promotions = 0
        self.limit = limit  # starvation limit; 0: none
        self.taken = None  # the running one-stage batch's StageEndEvent the replay takes over

    def save(self):
        return (self.d, self.free, self.blocks, len(self.grows), len(self.busy), self.received, self.promotions,
                [s.save() for s in self.streams])

    def restore(self, s) -> None:
        self.d, self.free, self.blocks, ng, nb, self.received, self.promotions, ss = s
        del self.grows[ng:]
        del self.busy[nb:]
        for st, old in zip(self.streams, ss):
            st.restore(old)

    def decide(self) -> _Stream:
        """The batch `schedule` forms now (every ready queue's attempt succeeds: `serve`
        checks its KV)."""
        ready = [s for s in self.streams if s.ready]
        if self.limit:
            d, limit = self.d, self.limit
            starving = [s for s in ready if d - s.since > limit]
            if starving:
                self.promotions += 1
                return min(starving, key=_head)
        return min(ready, key=_order)

    def serve(self, s: _Stream, x: float, horizon: float) -> float:
        """Run `s` from decision time x: its KV, the decision, its end (returned)."""
        if not s.pipe and s.left < 2:
            raise _Stop  # this step produces a request's last token
        need = 0
        for m in s.kv:
            target = m[3] + 1
            if target > m[0]:
                need += (-(-target // m[1]) - m[0] // m[1]) * m[2]
        if need:
            if need > self.blocks:
                raise _Stop
            self.blocks -= need
            grows = self.grows
            for m in s.kv:
                target = m[3] + 1
                if target > m[0]:
                    m[0] = -(-target // m[1]) * m[1]
                    grows.append((m[4], target))
        end = x + s.fn(s.csum + s.n)
        if not end < horizon:
            raise _Stop
        for m in s.kv:
            m[3] += 1
        s.since = self.d  # touched when served
        self.d += 1
        if s.first:
            s.formed += 1
        s.ready = False
        self.busy.append((x, end, s.n))
        s.csum += s.n
        if not s.pipe:  # back at once (one stage): waiting again from its end, the next decision
            s.left -= 1
            s.times.append(end)
            s.ready = True
            s.since = self.d
        self.free = end
        return end

    def run_to_pipe(self, a: float, horizon: float) -> tuple[float, float]:
        """A later stage: decide from `free` on until the pipeline's batch (arriving at a) runs;
        (its start, its end)."""
        p = self.pipe
        pushed = False
        while True:
            x = self.free
            if not pushed and a <= x:
                self._push(p)
                pushed = True
            if not pushed and not any(s.ready for s in self.streams):
                x = self.free = a  # idle until the batch arrives
                self._push(p)
                pushed = True
            s = self.decide()
            end = self.serve(s, x, horizon)
            if s is p:
                return x, end

    def run_to_tokens(self, tok: float, horizon: float) -> float:
        """The first stage: decide from `free` on until the tokens (at tok) are back; the time
        of the first decision that sees them (the cut, or the next cycle's start)."""
        while True:
            x = self.free
            if tok <= x:
                break
            if not any(s.ready for s in self.streams):
                x = self.free = tok
                break
            self.serve(self.decide(), x, horizon)
        if not x < horizon:
            raise _Stop
        self._push(self.pipe)
        return x

    def _push(self, s: _Stream) -> None:
        s.ready = True
        s.since = self.d
        if s.pipe and not s.first:
            self.received += 1


def _head(s: _Stream):
    return s.head


def _order(s: _Stream):
    return (s.cls, s.head)


class JointReplay:
    """The joint replay of one simulated cluster (see the module docstring)."""

    def __init__(self, ff):
        """`ff`: the cluster's `DecodeFastForward` (arrivals, residents, `_skip_arrivals`)."""
        self.ff = ff
        self.cluster = ff.cluster
        self.cycles = 0  # pipeline cycles replayed
        self.steps = 0  # one-stage steps replayed with them

    def advance(self, first, sb, t: float, route) -> float | None:
        """Replay whole cycles of `sb` (a multi-stage replica's first-stage decode batch, formed
        by `first` at t) with the group's one-stage batches; return the time `first` decides
        next, or None if no cycle can be replayed."""
        cluster = self.cluster
        sched0 = first.scheduler
        if sched0.policy.name != "full-batch-first" or sb.swap_in or sb.swap_out:
            return None
        model = sb.model
        rho = first.stages[model].replica
        pkey = (model, rho)
        counts = cluster.dispatcher.outstanding
        n = len(sb.requests)
        if counts(model)[rho] != n or cluster.route_pending[pkey] or first.pending:
            return None
        group = self._group(route, sb, pkey, t)
        if group is None:
            return None
        horizon = self._horizon(route, group, t)
        if not horizon > t:
            return None
        # the pipeline's stage times and hops (the handlers' expressions)
        nbytes = CostModel.hidden_bytes(first.stages[model].arch, n)
        hop = cluster.interconnect.transfer_time(nbytes)
        back = cluster.interconnect.latency_s
        for es in group:  # the running one-stage batches end (taken over below if a cycle replays)
            ev = es.taken
            if ev is not None:
                self._finish_running(es, ev, horizon)
                if es.free is None:
                    return None
        e0 = group[0]
        p0 = e0.pipe
        end0 = t + p0.fn(p0.csum + n)
        if not end0 < horizon or p0.left < 2:
            return None
        for m in p0.kv:
            m[3] += 1
        p0.csum += n
        e0.busy.append((t, end0, n))
        e0.free = end0
        times: list[float] = []  # the pipeline's token times
        k = 0
        cut = None
        saved = [es.save() for es in group]
        while True:
            try:
                if k:
                    if p0.left < 2 or e0.decide() is not p0:
                        raise _Stop
                    end0 = e0.serve(p0, cut, horizon)
                end = end0
                for es in group[1:]:
                    a = end + hop
                    if not a < horizon:
                        raise _Stop
                    _, end = es.run_to_pipe(a, horizon)
                tok = end + back
                if not tok < horizon:
                    raise _Stop
                nxt = e0.run_to_tokens(tok, horizon)
            except _Stop:
                for es, s in zip(group, saved):
                    es.restore(s)
                break
            p0.left -= 1
            times.append(end)
            cut = nxt
            k += 1
            saved = [es.save() for es in group]
        if not k:
            return None
        self._apply(group, route, sb, pkey, k, times, nbytes)
        return cut

    def _group(self, route, sb, pkey, t: float) -> list[_Engine] | None:
        """The replay's view of the route's engines, or None if its conditions fail."""
        cluster = self.cluster
        counts = cluster.dispatcher.outstanding
        records = cluster.records
        model = pkey[0]
        rids = [sr.req_id for sr in sb.requests]
        group = []
        for j, eng in enumerate(route):
            s = eng.scheduler
            if s.has_swapped or (j and eng.wake_pending):
                return None
            limit = 0 if s.starvation_limit == 0 else s.effective_starvation_limit
            es = _Engine(eng, limit)
            max_batch = s.max_batch_size
            running = None
            if j:
                if eng.busy:
                    ev = eng.running
                    if ev is None or ev.batch is None or eng.pending != [ev.time]:
                        return None
                    running = ev.batch
                    info = eng.stages[running.model]
                    if (running.kind != DECODE or not (info.first and info.last) or running.swap_in
                            or running.swap_out):
                        return None
                    es.taken = ev
                elif eng.pending:
                    return None
                es.free = t
                if s.has_queued(model):
                    return None
                preqs = [s.request(rid) for rid in rids]
                pipe = _Stream(pkey, preqs, _FULL if len(rids) >= max_batch else _SMALL,
                               (min(r.arrival for r in preqs), -1), eng.decode_time_fn(eng.stages[model], len(rids)),
                               False, True, None)
            else:
                preqs = [s.request(rid) for rid in rids]
                pipe = _Stream(pkey, preqs, _FULL if len(rids) >= max_batch else _SMALL,
                               min(r.key for r in preqs), eng.decode_time_fn(eng.stages[model], len(rids)),
                               True, True, None)
            es.pipe = pipe
            es.streams.append(pipe)
            arrivals = {pipe.head[0]}
            for m, info in eng.stages.items():
                if m == model:
                    continue
                if not (info.first and info.last):
                    return None
                st = s.stage_of(m)
                if st.prefill_q.items:
                    return None
                nr = counts(m)[info.replica]
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
                head = min(r.key for r in reqs)
                if head[0] in arrivals:
                    return None  # equal arrival times: the order could depend on the sequence numbers
                arrivals.add(head[0])
                r = _Stream((m, info.replica), reqs, _FULL if nr >= max_batch else _SMALL, head,
                            eng.decode_time_fn(info, nr), True, False, [records[x.req_id] for x in reqs])
                if running is None or running.model != m:
                    r.ready = True
                    r.since = q.since
                es.streams.append(r)
            if j and running is None and any(r.ready for r in es.streams):
                return None  # idle with work waiting (for KV, or deciding at this instant)
            group.append(es)
        p_last = group[-1].pipe
        group[0].pipe.left = p_last.left  # the last stage's count says when a request finishes
        group[0].pipe.recs = [records[rid] for rid in rids]
        return group

    def _finish_running(self, es: _Engine, ev, horizon: float) -> None:
        """The taken-over batch ends at its event's time: its token, back at once."""
        s = next(x for x in es.streams if x.key[0] == ev.batch.model)
        if s.left < 2 or not ev.time < horizon:
            es.free = None
            return
        for m in s.kv:
            m[3] += 1
        s.csum += s.n
        s.left -= 1
        s.times.append(ev.time)
        s.ready = True
        s.since = es.d
        es.busy.append((ev.start, ev.time, s.n))
        es.free = ev.time

    def _horizon(self, route, group: list[_Engine], t: float) -> float:
        """The first new request the dispatcher may send into the group (every route touching
        the group lies inside it, so nothing else can reach it)."""
        ff = self.ff
        seen = {eng.id for eng in route}
        frozen = {s.key for es in group for s in es.streams}
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

    def _apply(self, group: list[_Engine], route, sb, pkey, k: int, times: list[float], nbytes: int) -> None:
        """Apply the replayed cycles: metrics, scheduler states, KV, counters, the cut."""
        cluster = self.cluster
        metrics = cluster.metrics
        model = pkey[0]
        rids = [sr.req_id for sr in sb.requests]
        steps = 0
        for j, es in enumerate(group):
            eng = es.eng
            s = eng.scheduler
            ev = es.taken
            if ev is not None:  # the running one-stage batch completes, its tokens come back
                batch = ev.batch
                cluster.take_over(eng)
                s.receive_tokens(s.complete(batch).token_message)
            for x, y, size in es.busy:
                metrics.batch(eng.id, x, y, False, size, size)
            for r in es.streams:
                if r.pipe:
                    continue
                if r.formed:
                    s.replay_first_decode(r.key[0], r.rids, r.formed, r.since, False)
                    steps += r.formed
                if r.times:
                    metrics.token_steps(r.recs, r.times)
            if j:
                s.replay_later_decode(model, j, rids, k)
            else:
                s.replay_first_decode(model, rids, k, es.pipe.since, True)
            s.replay_grows(es.grows)
            formed = sum(r.formed for r in es.streams if not r.pipe) + (k - 1 if not j else 0)
            s.replay_counters(es.d, es.received, formed, es.promotions)
            if j:
                cluster.hold(eng, pkey, es.free)
            if cluster.check:
                s.check()
        for _ in range(k * (len(group) - 1)):
            metrics.hop(nbytes)
        metrics.token_steps(group[0].pipe.recs, times)
        self.cycles += k
        self.steps += steps
