"""The joint replay's group simulation: a pipeline's engines, event by event, without the loop.

Place in the data flow: `JointReplay.advance` (joint_replay.py) captures the start state of a
pipeline's engines (joint_capture.py, records in joint_state.py) and runs a `GroupSim` over
them: a small event simulation (stage ends, batch arrivals, token returns, in the event loop's
order at one instant) whose decisions are those `EngineScheduler.schedule` makes
(`GroupDecisions`, joint_decide.py), pausing at last tokens and at the horizon for the main
loop, up to the cut; `GroupSim.apply` then applies everything before the cut in bulk and hands
what is under way to real events (joint_cut.py).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from heapq import heappop, heappush
from typing import NamedTuple

from paraflex.costs.costmodel import CostModel
from paraflex.simulator.core.events import ReplayEndEvent
from paraflex.simulator.fastpath.joint_cut import apply_cut
from paraflex.simulator.fastpath.joint_decide import GroupDecisions, Stop
from paraflex.simulator.fastpath.joint_state import (ARRIVE, END, TOKENS, Admitted, Finished, GroupEngine, Joiner,
                                                     LateJoin, PipeBatch, ReplicaBatch)

INF = float("inf")


class GroupBounds(NamedTuple):
    """What bounds a replay's horizon: the models resident on the group, its engine ids, and
    the replicas whose unfinished counts cannot drop before a finish inside the replay."""

    models: set[str]
    engines: set[int]
    frozen: set[tuple[str, int]]


class Pause(NamedTuple):
    """An instant whose events the replay processed, the decisions of the engines touched
    there (in order) not yet made."""

    instant: float
    engines: tuple[int, ...]


class Finishing(NamedTuple):
    """Requests of a replica that produced their last token at the paused instant."""

    key: tuple[str, int]
    rids: list[str]


class GroupSim:
    """The group's event simulation from the start state to the cut, and its application."""

    def __init__(self, cluster, arrivals: dict[str, list[float]], group: list[GroupEngine], pkey, gen0: dict,
                 bounds: GroupBounds, horizon: float):
        self.cluster = cluster
        self.arrivals = arrivals  # each model's request arrival times, sorted
        self.group = group
        self.pkey = pkey
        self.gen0 = gen0  # first stage: tokens each pipeline request received
        s0 = group[0].eng.scheduler
        self.decisions = GroupDecisions(s0.policy, s0.max_batch_size)
        self.req0 = {rid: s0.request(rid) for rid in gen0}
        self.horizon = horizon
        self.heap: list = []  # local events: (time, kind, sequence number, stage, what)
        self.seq = 0
        self.decided = 0
        self.tokens: list = []  # (batch, time) of the pipeline's tokens, in time order
        self.gone: dict = {}  # the records of the pipeline's requests that finished in the replay
        self.hops: list[int] = []  # bytes of each replayed hop
        self.arch = group[0].info.arch
        self.back = cluster.topology.link(group[-1].eng.id, group[0].eng.id).latency_s
        self.last = len(group) - 1
        self.held: list[GroupEngine] = []  # engines that decide for real at the cut instant
        self.cut = None
        self.now = -1.0  # the last instant whose events it processed
        self.paused: Pause | None = None
        self.finishing: list[Finishing] = []  # the last tokens at the paused instant
        self.raw_from = self.raw_next = -1.0  # the first new request of the group's models after raw_from
        self.key0 = {rid: r.key for rid, r in self.req0.items()}  # first stage: each request's queue key
        self.hop_cache: dict[tuple[int, int], tuple[int, float]] = {}
        self.bounds = bounds

    def push(self, time: float, kind: int, j: int, what) -> None:
        heappush(self.heap, (time, kind, self.seq, j, what))
        self.seq += 1

    def run(self) -> None:
        """The local events in the event loop's order: everything at an instant first, then
        each engine touched at it decides, in engine order. Pauses after the events of an
        instant with last tokens (`finishing`: the dispatcher must see them at their time) or
        at the horizon; a later `run` goes on with that instant's decisions."""
        heap = self.heap
        group = self.group
        horizon = self.horizon
        decide = self.decisions.decide
        hop, hops, tokens, back, last_stage = self.hop, self.hops, self.tokens, self.back, self.last
        gen0, key0, req0 = self.gen0, self.key0.__getitem__, self.req0
        orders = _orders(len(group))
        paused, self.paused = self.paused, None  # a paused instant's decisions come first
        while True:
            if paused is not None:
                x, order = paused
                paused = None
            elif heap and heap[0][0] <= horizon:
                # every local event at instant x (one loop, no call per event: the replay's hot path)
                x = heap[0][0]
                touched = 0  # the engines touched (a bit mask)
                while True:
                    _, kind, _, j, what = heappop(heap)
                    es = group[j]
                    touched |= 1 << j
                    if kind == END:
                        es.running = None
                        cls = what.__class__
                        if cls is ReplicaBatch:
                            if what.left:
                                what.ready = True
                                es.nready += 1
                            else:
                                self.replica_finished(es, what)
                        elif cls is Joiner:
                            self.join(es, what)
                        elif cls is PipeBatch:
                            if j < last_stage:
                                nbytes, dt = hop(what.n, j)
                                hops.append(nbytes)
                                heappush(heap, (x + dt, ARRIVE, self.seq, j + 1, what))
                            else:
                                for rid in what.rids:
                                    if req0[rid].max_new_tokens - gen0[rid] < 2:  # a request's last token
                                        self.pipe_finish(what)
                                        break
                                tokens.append((what, x))
                                heappush(heap, (x + back, TOKENS, self.seq, 0, what))
                            self.seq += 1
                        # else: the end of a stage an earlier replay accounted for (HeldStage)
                    elif kind == ARRIVE:
                        q = es.queue
                        if not q:
                            es.since = es.d
                        insort(q, what, key=_batch_head)
                        es.received += 1
                        es.arrivals.append((what, es.d, es.received))
                    else:  # tokens back at the first stage: its requests wait for the next batch, or are done
                        q = es.queue
                        bid_of = es.bid_of
                        for rid in what.rids:
                            gen0[rid] += 1
                            del bid_of[rid]
                            if gen0[rid] == req0[rid].max_new_tokens:
                                self.pipe_free(es, rid)
                                continue
                            if not q:
                                es.since = es.d
                            insort(q, rid, key=key0)
                    if not heap or heap[0][0] != x:
                        break
                order = orders[touched]
                self.now = x
                if self.finishing or x == horizon:
                    self.paused = Pause(x, order)
                    return
            else:
                if heap:  # at the horizon, nothing of the group happens there
                    self.paused = Pause(horizon, ())
                return
            last = order[-1] if order else -1
            for i in order:  # each engine touched at x decides (after everything at x)
                es = group[i]
                if es.running is None and (es.queue or es.nready):
                    try:
                        decide(self, es, x, i == last)
                    except Stop:
                        self.hold(x, order[order.index(i):])
                        return

    def cut_paused(self) -> None:
        """Cut at the paused instant: the engines touched there decide for real."""
        x, order = self.paused
        self.paused = None
        self.hold(x, order)

    def hold(self, x: float, order) -> None:
        """The cut at x: the engines of `order` with work and nothing running decide for real."""
        self.cut = x
        self.held = [self.group[k] for k in order if self.group[k].running is None
                     and (self.group[k].queue or self.group[k].nready)]

    # ------------------------------------------------------------------ finishes and joins
    def replica_finished(self, es: GroupEngine, r: ReplicaBatch) -> None:
        """r's step with last tokens ended: those members finish (their KV is freed here, in
        order with the growth; `finishing` for the dispatcher and the records), the others
        go on as a smaller batch."""
        s = len(r.times)
        keep = [i for i, rem in enumerate(r.rems) if rem > s]
        gone = [r.rids[i] for i, rem in enumerate(r.rems) if rem <= s]
        for i, rem in enumerate(r.rems):
            if rem <= s:
                es.blocks += r.kv[i].blocks
                es.grows.append((None, r.rids[i]))
        r.done.append(Finished(gone, [r.recs[i] for i in range(r.n) if r.rems[i] <= s], s))
        self.finishing.append(Finishing(r.key, gone))
        r.fin = None
        r.rids = [r.rids[i] for i in keep]
        r.recs = [r.recs[i] for i in keep]
        r.kv = [r.kv[i] for i in keep]
        r.keys = [r.keys[i] for i in keep]
        r.rems = [r.rems[i] for i in keep]
        r.n = len(keep)
        r.csum = sum(kv.context for kv in r.kv)
        if r.n:
            r.resize(es.eng, self.decisions.decode_class(True, r.n))
            r.left = min(r.rems) - s
            r.ready = True
            es.nready += 1

    def pipe_finish(self, b: PipeBatch) -> None:
        """b's last stage ended with some members' last tokens: they finish here, as
        `Cluster._emit_tokens` finishes them (their KV freed on every stage but the first, which
        frees it when the tokens arrive; `finishing` for the dispatcher and the records, kept
        in `gone` for their tokens, recorded at the cut)."""
        fin = self.last_tokens(b)
        for es in self.group[1:]:
            for rid in fin:
                del es.pgen[rid]
                self.pipe_free(es, rid)
        self.finishing.append(Finishing(self.pkey, fin))
        records = self.cluster.records
        for rid in fin:
            self.gone[rid] = records[rid]

    def last_tokens(self, b: PipeBatch) -> list:
        """The members of b whose token at the last stage is their last."""
        req0, gen0 = self.req0, self.gen0
        return [rid for rid in b.rids if req0[rid].max_new_tokens - gen0[rid] < 2]

    @staticmethod
    def pipe_free(es: GroupEngine, rid: str) -> None:
        """A finished pipeline request's KV on es freed (in order with the growth)."""
        es.blocks += es.pkv.pop(rid).blocks
        es.grows.append((None, rid))
        es.gone.append(rid)

    def join(self, es: GroupEngine, jn: Joiner) -> None:
        """jn's prompt ended: the request (its first token out) waits in its replica's decode
        queue, in key order, and joins the batch the next decision forms there. (A prompt
        running since the replay began joins before the replica's first step in it; one the
        replay admitted may join after some: `ReplicaBatch.late`.)"""
        jn.joined = True
        r = next(r for r in es.replicas if r.key == jn.key)
        i = bisect_right(r.keys, jn.req_key)
        s = len(r.times)
        if s or r.formed:
            if r.late is None:
                r.late = {}
            r.late[jn.rid] = LateJoin(s, r.formed)
        r.rids.insert(i, jn.rid)
        r.recs.insert(i, jn.rec)
        r.keys.insert(i, jn.req_key)
        r.rems.insert(i, jn.rem + s)
        r.kv.insert(i, jn.kv)
        r.csum += jn.kv.context
        r.resize(es.eng, self.decisions.decode_class(True, len(r.rids)))
        r.left = jn.rem if r.n == 1 else min(r.left, jn.rem)
        if not r.ready:  # its queue was empty: non-empty from this decision on
            r.ready = True
            r.since = es.d
            es.nready += 1

    def admit(self, es: GroupEngine, adm: Admitted) -> None:
        """A new request comes into its prefill queue on es at the paused instant (it joins its
        replica, empty until now, or not, when its prompt ends); es decides at that instant if
        it is idle, as the request's wake-up makes it."""
        es.admitted = adm
        es.nready += 1
        es.received += 1  # (its sequence number)
        if all(r.key != adm.key for r in es.replicas):
            es.replicas.append(ReplicaBatch(adm.key, [], self.decisions.decode_class(True, 0), None, [], adm.info))
        self.bounds.frozen.add(adm.key)
        if es.running is None:
            x, order = self.paused
            self.paused = Pause(x, tuple(sorted({*order, es.j})))

    # ------------------------------------------------------------------ what the decisions ask
    def raw_after(self, x: float) -> float:
        """The first new request of the group's models after x (any replica)."""
        if not (self.raw_from <= x < self.raw_next):
            nxt = INF
            arrivals = self.arrivals
            for m in self.bounds.models:
                ts = arrivals.get(m)
                if ts:
                    i = bisect_right(ts, x)
                    if i < len(ts) and ts[i] < nxt:
                        nxt = ts[i]
            self.raw_from, self.raw_next = x, nxt
        return self.raw_next

    def hop(self, n: int, j: int) -> tuple[int, float]:
        """(bytes, transfer time) of a hop of n tokens from stage j to stage j + 1 (the handlers'
        expressions), cached per (n, j)."""
        h = self.hop_cache.get((n, j))
        if h is None:
            nbytes = CostModel.hidden_bytes(self.arch, n)
            src, dst = self.group[j].eng.id, self.group[j + 1].eng.id
            h = self.hop_cache[(n, j)] = (nbytes, self.cluster.topology.hop_time(src, dst, nbytes))
        return h

    # ------------------------------------------------------------------ the cut
    def take(self) -> None:
        """Take the replaced events off the heap's duty (they then do nothing)."""
        cluster = self.cluster
        model = self.pkey[0]
        for es in self.group:
            for ev in es.messages:
                cluster.take_message(ev)
            ev = es.taken
            if ev is not None:
                if not isinstance(ev, ReplayEndEvent) and ev.batch.model != model and es.joiner is None:
                    es.started = ev.batch  # a one-stage decode batch running at the start
                cluster.take_over(es.eng)

    def suspend(self) -> None:
        """Wait at the horizon (a new request that may come into the group) with the state
        intact: the engines stay busy (nothing else can reach them) until `JointReplay.arrival`
        resumes the replay or cuts it."""
        for es in self.group:
            es.eng.busy = True

    def apply(self) -> None:
        """Apply the replayed decisions in bulk (after `take`) and hand what is still under
        way to real events (joint_cut.py)."""
        apply_cut(self)


def _batch_head(b: PipeBatch) -> float:
    return b.head


_ORDERS: dict[int, list] = {}


def _orders(n: int) -> list:
    """For each bit mask of n engines, the engines set in it, in order."""
    o = _ORDERS.get(n)
    if o is None:
        o = _ORDERS[n] = [tuple(i for i in range(n) if m >> i & 1) for m in range(1 << n)]
    return o
