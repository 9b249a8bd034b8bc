"""Decode fast-forward: run many cycles of one decode batch in closed form, same results.

Place in the data flow: the fast path's hook (hook.py) offers `DecodeFastForward.advance` every
first-stage decode batch an engine's scheduler forms when the engines' policy names
`ExactReplay.decode_cycles` (on a multi-stage replica's engines the joint replay,
joint_replay.py, which replays the pipeline's batches together with the one-stage batches
sharing its engines, is offered it first). Step by step, one cycle of that batch is: the stage runs on each engine of its route (a `StageEndEvent` each, a hop and a
`BatchArrivalEvent` between stages), the last stage emits one token per request and sends them
back (`TokenArrivalEvent`), and the first engine schedules the same requests again: 3 to 4
events and a `schedule`/`complete` per stage, for one token per request. At low and moderate
load most cycles are undisturbed, and then this module replays k of them as arithmetic.

When (all checked at the moment the first engine formed the batch, at time t):

- the batch is a pure decode batch of a first stage, moving no KV between device and host,
  and holds every unfinished request of its replica;
- no other engine of the route is running something; no engine of the route holds swapped KV;
- on a one-stage route, the engine's other non-empty queues all come later in the policy's
  order (class, then head key) than this batch's queue, and the replay stops before any of
  them reaches its starvation promotion (`QueueOrder.repeatable_decisions`); on a longer
  route no engine of the route has queued work (an idle stage would run it between steps);
- horizon: every cycle replayed ends (its tokens are back at the first engine) strictly before
  the first event that can reach the route: events pending at its engines; events of another
  (model, replica) with unfinished requests whose route touches it (its pending events, and
  the next events of engines where its work waits in a queue, searched transitively, since
  such an engine decides at its own next event); and new requests for models resident on the
  engines searched, except those the dispatcher provably sends to a replica
  away from them (`_skip_arrivals`);
- no request of the batch produces its last token in a replayed cycle (finishing frees KV and
  wakes other engines: that cycle runs through the ordinary events);
- each engine's pool has free blocks for the KV the cycles add (kv_growth.py: no eviction is considered).

Then the outcome of each cycle is known: the scheduler would pick these requests again, and
each stage starts when its input arrives. The replay records the same metrics at the same times (stage
intervals, batch sizes, hops, one token per request per cycle, computed with the same float
expressions as the event handlers) and moves each engine's scheduler state forward in bulk
(`BulkAdvance.advance_first_decode` / `advance_later_decode`), allocating the same blocks in
the same order. The first engine then forms the next batch through the ordinary `schedule` at
the time the last replayed tokens arrive. Exactness is pinned by tests/simulator/test_sim_fast_forward.py
(per-request timelines and summaries identical with and without it, on random workloads).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from paraflex.costs.costmodel import CostModel
from paraflex.engine.core.queue_order import UNBOUNDED
from paraflex.simulator.fastpath.kv_growth import MemberKV, first_crossing, fit_step


class DecodeFastForward:
    """The fast-forward of one simulated cluster (see the module docstring)."""

    def __init__(self, cluster, requests):
        """`requests`: every request of the run (their arrival times bound each replay)."""
        self.cluster = cluster
        arrivals: dict[str, list[float]] = {}
        for req in requests:
            arrivals.setdefault(req.model, []).append(req.arrival)
        self.arrivals = {m: sorted(ts) for m, ts in arrivals.items()}
        # per engine: the models resident on it, and every (model, replica) whose route touches it
        self.models_on: list[list[str]] = [list(e.stages) for e in cluster.engines]
        self.routes_on: list[list[tuple[str, int]]] = [[] for _ in cluster.engines]
        self.route_sets = {m: [frozenset(route) for route in routes] for m, routes in cluster.replicas.items()}
        for model, routes in cluster.replicas.items():
            for rho, route in enumerate(routes):
                for eid in route:
                    self.routes_on[eid].append((model, rho))
        self.cycles = 0  # cycles replayed (for the summary)

    def _replay_one_stage(self, eng, info, n, kv, free, k_max, horizon, recs, t):
        """Cycles of a one-stage replica: back to back on one engine, the tokens return at
        once (`Cluster._emit_tokens`: no delay to the same engine). Returns (cycles, end)."""
        step = eng.decode_time_fn(info, n)
        ctx = sum(m.context for m in kv[0])
        kv_next = first_crossing(kv)
        ends = []
        s = t
        k = 0
        while k < k_max:
            end = s + step(ctx)
            if not end < horizon:
                break
            if k >= kv_next:
                if not fit_step(kv, free, k):
                    break
                kv_next = first_crossing(kv)
            ends.append(end)
            s = end
            ctx += n
            k += 1
        if k:
            metrics = self.cluster.metrics
            metrics.decode_run(eng.id, t, ends, n)
            metrics.token_steps(recs, ends)
        return k, s

    def _replay_pipeline(self, route, infos, n, kv, free, k_max, horizon, recs, t):
        """Cycles through several stages: hop between stages, token latency back to the first."""
        cluster = self.cluster
        metrics = cluster.metrics
        nbytes = CostModel.hidden_bytes(infos[0].arch, n)
        topology = cluster.topology
        hops = [0.0] + [topology.hop_time(a.id, b.id, nbytes) for a, b in zip(route, route[1:])]
        back = topology.link(route[-1].id, route[0].id).latency_s
        stages = [(eng.id, eng.decode_time_fn(inf, n)) for eng, inf in zip(route, infos)]
        ctx = sum(m.context for m in kv[0])
        kv_next = first_crossing(kv)
        s = t
        k = 0
        while k < k_max:
            tt = s
            times = []
            for j, (eid, step) in enumerate(stages):
                if j:
                    tt = tt + hops[j]
                end = tt + step(ctx)
                times.append((eid, tt, end))
                tt = end
            nxt = tt + back
            if not nxt < horizon:
                break
            if k >= kv_next:
                if not fit_step(kv, free, k):
                    break
                kv_next = first_crossing(kv)
            for eid, a, b in times:
                metrics.batch(eid, a, b, False, n, n)
            for _ in range(len(stages) - 1):
                metrics.hop(nbytes)
            metrics.tokens(recs, tt)
            s = nxt
            ctx += n
            k += 1
        return k, s

    def _window(self, first, sb, replica: int, route, t: float) -> tuple[int, float]:
        """(cycles the scheduler decisions allow, horizon): (0, t) if no cycle can be replayed."""
        cluster = self.cluster
        counts = cluster.dispatcher.outstanding
        if counts(sb.model)[replica] != len(sb.requests):
            return 0, t
        for eng in route:
            if (eng is not first and eng.busy) or eng.scheduler.has_swapped:
                return 0, t
        # no cycle ends before its first stage does: stop looking once the horizon is that near
        first_end = t + first.decode_time(first.stages[sb.model], len(sb.requests), sum(sr.context_len for sr in sb.requests))
        ours = (sb.model, replica)
        if self._event_before(route, ours, first_end):
            return 0, t
        if len(route) == 1:  # its engine decides once per cycle, with its other queues waiting
            budget = first.scheduler.order.repeatable_decisions(first.scheduler.stage_of(sb.model)) + 1
        elif any(eng.scheduler.has_ready_work() for eng in route):
            return 0, t  # an idle stage would run that work between two of this batch's steps
        else:
            budget = UNBOUNDED
        horizon = self._horizon(route, ours, t, first_end)
        return (budget, horizon) if horizon > first_end else (0, t)

    def _event_before(self, route, ours: tuple[str, int], when: float) -> bool:
        """True if an event already on the heap reaches the route by `when`: one pending at
        its engines, or one of another replica touching it (most refusals; `_horizon` does
        the full search)."""
        counts = self.cluster.dispatcher.outstanding
        route_pending = self.cluster.route_pending
        for eng in route:
            if eng.pending and min(eng.pending) <= when:
                return True
            for key in self.routes_on[eng.id]:
                times = route_pending[key]
                if times and key != ours and counts(key[0])[key[1]] and min(times) <= when:
                    return True
        return False

    def _horizon(self, route, ours: tuple[str, int], t: float, enough: float) -> float:
        """A time before which no event can reach the route's engines (t: none can be shown;
        any time <= `enough` once the search finds one).

        Events at the route's engines are pending there, or come from another (model,
        replica) with unfinished requests touching the route. Such a replica's next event is
        one of its pending events, or follows a decision of an engine (off the route) where
        its work waits in a queue; that engine decides at its own next event, at a wake-up
        now, or when another replica's event reaches it (the same question again), or when a
        new request arrives for a model resident there."""
        cluster = self.cluster
        counts = cluster.dispatcher.outstanding
        route_pending = cluster.route_pending
        horizon = float("inf")
        on_route = {eng.id for eng in route}
        models: set[str] = set()
        todo: list[tuple[str, int]] = []
        for eng in route:
            if eng.pending:
                horizon = min(horizon, min(eng.pending))
            models.update(self.models_on[eng.id])
            todo.extend(self.routes_on[eng.id])
        if horizon <= enough:
            return horizon
        seen_routes = {ours}
        seen_engines = set(on_route)
        engines = cluster.engines
        while todo:
            key = todo.pop()
            if key in seen_routes:
                continue
            seen_routes.add(key)
            m, rho = key
            if not counts(m)[rho]:
                continue
            times = route_pending[key]
            if times:
                horizon = min(horizon, min(times))
                if horizon <= enough:
                    return horizon
            for e in cluster.replicas[m][rho]:
                if e in seen_engines:
                    continue
                eng = engines[e]
                if not eng.scheduler.has_queued(m):
                    continue
                seen_engines.add(e)
                if eng.wake_pending:
                    return t
                if eng.pending:
                    horizon = min(horizon, min(eng.pending))
                models.update(self.models_on[e])
                todo.extend(self.routes_on[e])
        # replicas whose unfinished count cannot drop before the horizon: this one, and on a
        # one-stage route the other one-stage replicas of its engine (their requests wait there)
        frozen = {ours}
        if len(route) == 1:
            frozen.update(key for key in self.routes_on[route[0].id] if len(cluster.replicas[key[0]][key[1]]) == 1)
        return self.arrival_horizon(models, t, horizon, seen_engines, frozen)

    def arrival_horizon(self, models, t: float, horizon: float, seen: set[int], frozen) -> float:
        """The first arrival after `t` of a request of `models` that can reach the engines `seen`
        before `horizon` (requests a `frozen` replica would take are skipped), else `horizon`."""
        arrivals = self.arrivals
        for m in models:
            ts = arrivals.get(m)
            if ts:
                i = bisect_right(ts, t)
                if i < len(ts) and ts[i] < horizon:
                    i = self._skip_arrivals(m, ts, i, horizon, seen, frozen)
                    if i < len(ts) and ts[i] < horizon:
                        horizon = ts[i]
        return horizon

    def _skip_arrivals(self, m: str, ts: list[float], i: int, horizon: float, seen: set[int], frozen) -> int:
        """Skip the arrivals ts[i:] of `m` (before the horizon) that provably go to a replica
        whose route avoids the engines `seen`; return the index of the first that may not.

        The dispatcher sends a request to the replica with the fewest unfinished requests.
        Counts only fall between arrivals, except the frozen replicas' (which stay). So an
        arrival goes elsewhere if every replica touching `seen` holds more (a lower bound: its
        count if frozen, else 0) than the least loaded of the others can hold by then (an
        upper bound: their counts now, plus the skipped arrivals, each on the least loaded).
        Home-first dispatch (engine/core/dispatcher.py) sends it home or by the same rule, so
        the proof holds when the model's home avoids `seen`; none is skipped otherwise. Least-load
        dispatch weighs every resident model's requests, so none is skipped under it."""
        cluster = self.cluster
        if cluster.dispatcher.loads is not None:
            return i
        home = cluster.dispatcher.homes.get(m)
        if home is not None and not self.route_sets[m][home].isdisjoint(seen):
            return i
        counts = cluster.dispatcher.outstanding(m)
        floor = None
        others = []
        for rho, route in enumerate(self.route_sets[m]):
            if not route.isdisjoint(seen):
                lb = counts[rho] if (m, rho) in frozen else 0
                floor = lb if floor is None or lb < floor else floor
            else:
                others.append(counts[rho])
        if not others or floor is None:
            return i
        return i + skippable(others, floor, ts, i, horizon)

    def advance(self, first, sb, t: float) -> float | None:
        """Replay as many cycles of `sb` (formed by `first` at `t`) as provably undisturbed;
        return the time its requests are back in `first`'s decode queue, or None if none."""
        cluster = self.cluster
        info = first.stages[sb.model]
        replica = info.replica
        route = [cluster.engines[e] for e in cluster.replicas[sb.model][replica]]
        budget, horizon = self._window(first, sb, replica, route, t)
        if budget < 1:
            return None
        rids = [sr.req_id for sr in sb.requests]
        n = len(rids)
        last_reqs = [route[-1].scheduler.request(rid) for rid in rids]
        k_max = min(budget, min(r.max_new_tokens - r.generated for r in last_reqs) - 1)  # no last token
        if k_max < 1:
            return None
        infos = [eng.stages[sb.model] for eng in route]
        # KV: per engine, blocks still free and each member's KV, from its context after the first cycle
        free = [eng.pool.num_free for eng in route]
        kv = [[MemberKV(eng.scheduler.request(sr.req_id).alloc, sr.context_len) for sr in sb.requests] for eng in route]
        records = cluster.records
        recs = [records[rid] for rid in rids]
        if len(route) == 1:
            k, s = self._replay_one_stage(first, info, n, kv, free, k_max, horizon, recs, t)
        else:
            k, s = self._replay_pipeline(route, infos, n, kv, free, k_max, horizon, recs, t)
        if not k:
            return None
        first.scheduler.bulk.advance_first_decode(sb, k)
        for eng, inf in zip(route[1:], infos[1:]):
            eng.scheduler.bulk.advance_later_decode(sb.model, inf.stage, rids, k)
        if cluster.check:
            for eng in route:
                eng.scheduler.check()
        self.cycles += k
        return s


def skippable(others: list[int], floor: int, ts: list[float], i: int, horizon: float) -> int:
    """How many of the arrivals ts[i:] before `horizon` go to `others` (counts of the replicas
    away from the engines searched) while each goes to the least loaded of them and it holds
    fewer than `floor`: water-filling, they take sum(floor - count) arrivals before the least
    loaded holds `floor` (tests check it against arrival-by-arrival filling)."""
    room = sum(floor - c for c in others if c < floor)
    return bisect_left(ts, horizon, i, min(len(ts), i + room)) - i if room else 0

