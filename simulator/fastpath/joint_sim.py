"""The joint replay's group simulation: the decisions of a pipeline's engines, computed.

Place in the data flow: `JointReplay.advance` (joint_replay.py) captures the start state of a
pipeline's engines (joint_state.py: `GroupEngine`, `PipeBatch`, `ReplicaBatch`, `Joiner`) and
runs a `GroupSim` over them:
a small event simulation (stage ends, batch arrivals, token returns, in the event loop's order
at one instant) whose decisions are those `EngineScheduler.schedule` makes (see
joint_replay.py), pausing at last tokens and at the horizon for the main loop, up to the cut;
`GroupSim.apply` then applies everything before the cut in bulk and hands what is under way to
real events (joint_cut.py).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from heapq import heappop, heappush

from paraflex.costs.costmodel import CostModel
from paraflex.simulator.core.events import ReplayEndEvent
from paraflex.simulator.fastpath.joint_cut import apply_cut
from paraflex.simulator.fastpath.joint_state import ARRIVE, END, SMALL, TOKENS, Admitted, GroupEngine, Joiner, PipeBatch, ReplicaBatch
INF = float("inf")


class Stop(Exception):
    """A decision the replay cannot apply in bulk: cut here."""


class GroupSim:
    """The group's event simulation from the start state to the cut, and its application."""

    def __init__(self, cluster, group: list[GroupEngine], pkey, gen0: dict, bounds, horizon: float):
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
        self.gone: dict = {}  # the records of the pipeline's requests that finished in the replay
        self.hops: list[int] = []  # bytes of each replayed hop
        self.arch = group[0].info.arch
        self.back = cluster.interconnect.latency_s
        self.last = len(group) - 1
        self.held: list[GroupEngine] = []  # engines that decide for real at the cut instant
        self.cut = None
        self.now = -1.0  # the last instant whose events it processed
        self.paused = None  # (instant, engines touched): its events done, its decisions not yet
        self.finishing: list = []  # (replica key, request ids) of the last tokens at the paused instant
        self.raw = (-1.0, -1.0)  # (t, the first new request of the group's models after t)
        self.key0 = {rid: r.key for rid, r in self.req0.items()}  # first stage: each request's queue key
        self.hop_cache: dict[int, tuple[int, float]] = {}
        self.bounds = bounds  # (models, engine ids, frozen replicas) for `FastForward.arrival_horizon`

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
        decide = self._decide
        serve_pipe = self._serve_pipe
        hop = self.hop
        hops, tokens = self.hops, self.tokens
        back = self.back
        last_stage = self.last
        gen0, key0, req0 = self.gen0, self.key0.__getitem__, self.req0
        orders = _orders(len(group))
        finished = self._finished
        paused, self.paused = self.paused, None  # a paused instant's decisions come first
        while True:
            if paused is not None:
                x, order = paused
                paused = None
            elif heap and heap[0][0] <= horizon:
                x = heap[0][0]
                touched = 0
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
                                finished(es, what)
                        elif cls is Joiner:
                            self._join(es, what)
                        elif cls is PipeBatch:
                            if j < last_stage:
                                nbytes, dt = hop(what.n)
                                hops.append(nbytes)
                                heappush(heap, (x + dt, ARRIVE, self.seq, j + 1, what))
                            else:
                                for rid in what.rids:
                                    if req0[rid].max_new_tokens - gen0[rid] < 2:  # a request's last token
                                        self._pipe_finish(what)
                                        break
                                tokens.append((what, x))
                                heappush(heap, (x + back, TOKENS, self.seq, 0, what))
                            self.seq += 1
                        # else: the end of a stage an earlier replay accounted for
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
                                self._pipe_free(es, rid)
                                continue
                            if not q:
                                es.since = es.d
                            insort(q, rid, key=key0)
                    if not heap or heap[0][0] != x:
                        break
                order = orders[touched]
                self.now = x
                if self.finishing or x == horizon:
                    self.paused = (x, order)
                    return
            else:
                if heap:  # at the horizon, nothing of the group happens there
                    self.paused = (horizon, ())
                return
            last = order[-1] if order else -1
            for i in order:  # each engine touched at x decides (after everything at x)
                es = group[i]
                if es.running is None and (es.queue or es.nready):
                    try:
                        if es.nready:
                            decide(es, x, i == last)
                        else:  # only the pipeline's queue: `_decide` would serve it
                            limit = es.limit
                            promoted = limit and es.d - es.since > limit
                            serve_pipe(es, x)
                            if promoted:
                                es.promotions += 1
                            self.decided += 1
                    except Stop:
                        self._hold(x, order[order.index(i):])
                        return

    def cut_paused(self) -> None:
        """Cut at the paused instant: the engines touched there decide for real."""
        x, order = self.paused
        self.paused = None
        self._hold(x, order)

    def _hold(self, x: float, order) -> None:
        """The cut at x: the engines of `order` with work and nothing running decide for real."""
        self.cut = x
        self.held = [self.group[k] for k in order if self.group[k].running is None
                     and (self.group[k].queue or self.group[k].nready)]

    def _finished(self, es: GroupEngine, r: ReplicaBatch) -> None:
        """r's step with last tokens ended: those members finish (their KV is freed here, in
        order with the growth; `finishing` for the dispatcher and the records), the others
        go on as a smaller batch."""
        s = len(r.times)
        keep = [i for i, rem in enumerate(r.rems) if rem > s]
        gone = [r.rids[i] for i, rem in enumerate(r.rems) if rem <= s]
        for i, rem in enumerate(r.rems):
            if rem <= s:
                kv = r.kv[i]
                es.blocks += kv[0] // kv[1] * kv[2]
                es.grows.append((None, r.rids[i]))
        r.done.append((gone, [r.recs[i] for i in range(r.n) if r.rems[i] <= s], s))
        self.finishing.append((r.key, gone))
        r.fin = None
        r.rids = [r.rids[i] for i in keep]
        r.recs = [r.recs[i] for i in keep]
        r.kv = [r.kv[i] for i in keep]
        r.keys = [r.keys[i] for i in keep]
        r.rems = [r.rems[i] for i in keep]
        r.n = len(keep)
        r.csum = sum(kv[3] for kv in r.kv)
        if r.n:
            r.resize(es.eng)
            r.left = min(r.rems) - s
            r.ready = True
            es.nready += 1

    def _pipe_finish(self, b: PipeBatch) -> None:
        """b's last stage ended with some members' last tokens: they finish here, as
        `Cluster._emit_tokens` finishes them (their KV freed on every stage but the first, which
        frees it when the tokens arrive; `finishing` for the dispatcher and the records, kept
        in `gone` for their tokens, recorded at the cut)."""
        fin = self.last_tokens(b)
        for es in self.group[1:]:
            for rid in fin:
                del es.pgen[rid]
                self._pipe_free(es, rid)
        self.finishing.append((self.pkey, fin))
        records = self.cluster.records
        for rid in fin:
            self.gone[rid] = records[rid]

    def last_tokens(self, b: PipeBatch) -> list:
        """The members of b whose token at the last stage is their last."""
        req0, gen0 = self.req0, self.gen0
        return [rid for rid in b.rids if req0[rid].max_new_tokens - gen0[rid] < 2]

    @staticmethod
    def _pipe_free(es: GroupEngine, rid: str) -> None:
        """A finished pipeline request's KV on es freed (in order with the growth)."""
        kv = es.pkv.pop(rid)
        es.blocks += kv[0] // kv[1] * kv[2]
        es.grows.append((None, rid))
        es.gone.append(rid)

    def _join(self, es: GroupEngine, jn: Joiner) -> None:
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
            r.late[jn.rid] = (s, r.formed)
        r.rids.insert(i, jn.rid)
        r.recs.insert(i, jn.rec)
        r.keys.insert(i, jn.req_key)
        r.rems.insert(i, jn.rem + s)
        r.kv.insert(i, jn.kv)
        r.csum += jn.kv[3]
        r.resize(es.eng)
        r.left = jn.rem if r.n == 1 else min(r.left, jn.rem)
        if not r.ready:  # its queue was empty: non-empty from this decision on
            r.ready = True
            r.since = es.d
            es.nready += 1

    def _raw_after(self, x: float) -> float:
        """The first new request of the group's models after x (any replica)."""
        t, nxt = self.raw
        if not (t <= x < nxt):
            nxt = INF
            arrivals = self.cluster.fast_forward.arrivals
            for m in self.bounds[0]:
                ts = arrivals.get(m)
                if ts:
                    i = bisect_right(ts, x)
                    if i < len(ts) and ts[i] < nxt:
                        nxt = ts[i]
            self.raw = (x, nxt)
        return nxt

    def hop(self, n: int) -> tuple[int, float]:
        """(bytes, transfer time) of a hop of n tokens (the handlers' expressions), cached per n."""
        h = self.hop_cache.get(n)
        if h is None:
            nbytes = CostModel.hidden_bytes(self.arch, n)
            h = self.hop_cache[n] = (nbytes, self.cluster.interconnect.transfer_time(nbytes))
        return h

    def _decide(self, es: GroupEngine, x: float, last: bool) -> None:
        """The decision `schedule` makes at x (every attempt succeeds: the serve checks KV);
        `last`: no other engine decides at x after this one."""
        limit = es.limit
        d = es.d
        best = best_order = None
        starving = None
        if es.nready:
            for r in es.replicas:
                if r.ready:
                    if limit and d - r.since > limit:
                        if starving is None:
                            starving = []
                        starving.append((r.head, r))
                    if best is None or r.order < best_order:
                        best, best_order = r, r.order
        adm = es.admitted
        if adm is not None:  # a new request's prompt waits in its prefill queue
            if limit and d - adm.since > limit:
                if starving is None:
                    starving = []
                starving.append((adm.order[1], adm))
            if best is None or adm.order < best_order:
                best, best_order = adm, adm.order
        q = es.queue
        if q:  # the pipeline's queue (None below)
            head = self.key0[q[0]] if es.j == 0 else (q[0].head, 0)
            if limit and d - es.since > limit:
                if starving is None:
                    starving = []
                starving.append((head, None))
            if best is None or (SMALL, head) < best_order:
                best = None
        if starving:  # the oldest head among the queues past the starvation limit
            best = min(starving, key=_first)[1]
        if best is None:
            self._serve_pipe(es, x)
        elif best is adm:
            self._serve_prompt(es, adm, x)
        else:
            self._serve_replica(es, best, x, last)
        if starving:  # (counted once served: a decision the replay cannot apply is not its own)
            es.promotions += 1
        self.decided += 1

    @staticmethod
    def _grow(es: GroupEngine, kvs) -> bool:
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

    def _serve_replica(self, es: GroupEngine, r: ReplicaBatch, x: float, last: bool) -> None:
        """Run r's decode batch from x; while r is alone on its engine and nothing can reach the
        engine before its step ends (the next local event and the next new request of the
        group's models come later, and with `last` no other decision at x can add an earlier
        event), its next decisions are r again: chain them here (never a step with last tokens)."""
        g = len(es.grows)
        if not self._grow(es, r.kv):
            raise Stop  # eviction
        if r.left == 1:  # its members' last tokens (at its end, `_finished`)
            r.fin = (x, g)
        r.ready = False
        es.nready -= 1
        heap = self.heap
        alone = last and not es.queue and not es.nready
        if alone:  # (a step chained here must end before any new request: a finish elsewhere may move the horizon)
            bound = min(heap[0][0] if heap else INF, self.horizon, self._raw_after(x))
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
        es.running = r
        heappush(heap, (end, END, self.seq, es.j, r))
        self.seq += 1

    def admit(self, es: GroupEngine, adm: Admitted) -> None:
        """A new request comes into its prefill queue on es at the paused instant (it joins its
        replica, empty until now, or not, when its prompt ends); es decides at that instant if
        it is idle, as the request's wake-up makes it."""
        es.admitted = adm
        es.nready += 1
        es.received += 1  # (its sequence number)
        if all(r.key != adm.key for r in es.replicas):
            es.replicas.append(ReplicaBatch(adm.key, [], SMALL, None, [], adm.info))
        self.bounds[2].add(adm.key)
        if es.running is None:
            x, order = self.paused
            self.paused = (x, tuple(sorted({*order, es.j})))

    def _serve_prompt(self, es: GroupEngine, adm: Admitted, x: float) -> None:
        """Form adm's prompt batch at x (`FirstStageBatches.prefill`: admitted if its KV fits above the
        watermark; else `schedule` would go on to other queues: cut), to run its whole prompt;
        at its end the request joins its replica (`Joiner`)."""
        if es.eng.scheduler.kv.watermark_blocks + adm.blocks > es.blocks:
            raise Stop
        es.nready -= 1
        adm.formed = True
        adm.d, adm.mark, adm.busy_mark = es.d, len(es.grows), len(es.busy)
        es.blocks -= adm.blocks
        es.d += 1
        adm.batch_seq = es.formed
        es.formed += 1
        end = x + es.eng.prefill_time(adm.info, adm.prompt_len, 1)
        jn = Joiner.of_admitted(adm, x, end)
        es.admitted = None
        es.prompts.append(jn)
        es.running = jn
        heappush(self.heap, (end, END, self.seq, es.j, jn))
        self.seq += 1

    def _serve_pipe(self, es: GroupEngine, x: float) -> None:
        pkv = es.pkv
        if es.j == 0:  # the waiting requests form one batch (fewer than max_batch_size)
            rids = es.queue  # (sorted by key: its head is the earliest arrival)
            bid = f"{self.pkey[0]}/e{es.eng.id}/{es.batch_seq + es.formed + 1}"
            b = PipeBatch(rids, [pkv[rid][3] for rid in rids], bid, x, self.key0[rids[0]][0])
        else:
            b = es.queue[0]
        n = b.n
        fn = es.fns.get(n)
        if fn is None:
            fn = es.fns[n] = es.eng.decode_time_fn(es.info, n)
        end = x + fn(b.csum + n)
        if not self._grow(es, [pkv[rid] for rid in b.rids]):
            raise Stop  # it would evict
        if es.j == 0:
            es.queue = []
            es.formed += 1
            bid_of = es.bid_of
            for rid in b.rids:
                bid_of[rid] = bid
        else:
            del es.queue[0]
            if id(b) in es.queued:
                es.served_queued += 1
            pgen = es.pgen
            for rid in b.rids:
                pgen[rid] += 1
        es.since = es.d
        es.d += 1
        es.busy.append((x, end, n))
        es.running = b
        heappush(self.heap, (end, END, self.seq, es.j, b))
        self.seq += 1

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


def _first(pair):
    return pair[0]


_ORDERS: dict[int, list] = {}


def _orders(n: int) -> list:
    """For each bit mask of n engines, the engines set in it, in order."""
    o = _ORDERS.get(n)
    if o is None:
        o = _ORDERS[n] = [tuple(i for i in range(n) if m >> i & 1) for m in range(1 << n)]
    return o
