"""The joint replay's decisions: what `EngineScheduler.schedule` picks on a group engine, computed.

Place in the data flow: `GroupSim` (joint_sim.py) calls `GroupDecisions.decide` for each engine
of the group that must decide at an instant. No policy rule is restated here: the queues are
ordered as the scheduler's `QueueOrder` orders them (a queue not served for more than the
starvation limit first, oldest head; else the least (class, head key)), with each queue's class
from the policy's own `class_of` (engine/core/policies/), and served as `Policy.attempt` serves
them, which is what a policy naming `ExactReplay.pipeline_group` promises: a first stage's
whole decode queue, a whole prompt admitted above `KVPlanner.admission_reserve`, a received
batch whole. KV grows as `KVPlanner.fit` grows it (kv_growth.py); a decision that would evict,
or a prompt that is not admitted, raises `Stop`: the replay is cut there.
"""

from __future__ import annotations

from heapq import heappush

from paraflex.simulator.fastpath.joint_state import END, Admitted, GroupEngine, Joiner, LastStep, PipeBatch, ReplicaBatch
from paraflex.simulator.fastpath.kv_growth import grow_by_one_token

INF = float("inf")


class Stop(Exception):
    """A decision the replay cannot apply in bulk: cut here."""


class GroupDecisions:
    """The decisions of the group's engines during one replay, by the engines' `policy`. Each
    call gets the replay's `GroupSim`, whose local event heap, horizon and counters it moves
    (passed, not kept: the replay's objects form no reference cycle, so they are freed as soon
    as it ends while the event loop runs with the cyclic GC paused)."""

    def __init__(self, policy, max_batch_size: int):
        self.class_of = policy.class_of
        self.max_batch = max_batch_size
        # the policy class of a decode queue by its length, at a first stage and at a later one
        self.decode_classes: tuple[dict[int, int], dict[int, int]] = ({}, {})

    def decode_class(self, first_stage: bool, n: int) -> int:
        """The policy class of a decode queue holding n requests (first stage) or batches."""
        classes = self.decode_classes[first_stage]
        cls = classes.get(n)
        if cls is None:
            cls = classes[n] = self.class_of("decode", first_stage, n, self.max_batch)
        return cls

    def prefill_class(self) -> int:
        """The policy class of a first stage's prefill queue holding one prompt."""
        return self.class_of("prefill", True, 1, self.max_batch)

    def decide(self, sim, es: GroupEngine, x: float, last: bool) -> None:
        """The decision `schedule` makes on es at x (every attempt succeeds: the serve checks
        KV); `last`: no other engine decides at x after this one."""
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
            head = sim.key0[q[0]] if es.j == 0 else (q[0].head, 0)
            if limit and d - es.since > limit:
                if starving is None:
                    starving = []
                starving.append((head, None))
            if best is not None:  # (its class, from the cache: `decode_class`)
                cls = self.decode_classes[es.j == 0].get(len(q))
                if cls is None:
                    cls = self.decode_class(es.j == 0, len(q))
                if (cls, head) < best_order:
                    best = None  # the pipeline's queue comes first
        if starving:  # the oldest head among the queues past the starvation limit
            best = min(starving, key=_first)[1]
        if best is None:
            self.serve_pipe(sim, es, x)
        elif best is adm:
            self.serve_prompt(sim, es, adm, x)
        else:
            self.serve_replica(sim, es, best, x, last)
        if starving:  # (counted once served: a decision the replay cannot apply is not its own)
            es.promotions += 1
        sim.decided += 1

    def serve_replica(self, sim, es: GroupEngine, r: ReplicaBatch, x: float, last: bool) -> None:
        """Run r's decode batch from x; while r is alone on its engine and nothing can reach the
        engine before its step ends (the next local event and the next new request of the
        group's models come later, and with `last` no other decision at x can add an earlier
        event), its next decisions are r again: chain them here (never a step with last tokens)."""
        g = len(es.grows)
        if not grow_by_one_token(es, r.kv):
            raise Stop  # eviction
        if r.left == 1:  # its members' last tokens (at its end, `GroupSim.finished`)
            r.fin = LastStep(x, g)
        r.ready = False
        es.nready -= 1
        heap = sim.heap
        alone = last and not es.queue and not es.nready
        if alone:  # (a step chained here must end before any new request: a finish elsewhere may move the horizon)
            bound = min(heap[0][0] if heap else INF, sim.horizon, sim.raw_after(x))
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
            if not (alone and end < bound and r.left >= 2 and grow_by_one_token(es, kv)):
                break
            x = end  # the engine decides at this end: r again
            sim.decided += 1
        r.since = es.d  # served at decision d, back (non-empty again) before the next
        es.running = r
        heappush(heap, (end, END, sim.seq, es.j, r))
        sim.seq += 1

    def serve_prompt(self, sim, es: GroupEngine, adm: Admitted, x: float) -> None:
        """Form adm's prompt batch at x (`FirstStageBatches.prefill`: admitted if its KV fits
        above the admission reserve; else `schedule` would go on to other queues: cut), to run
        its whole prompt; at its end the request joins its replica (`Joiner`)."""
        if es.reserve + adm.blocks > es.blocks:
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
        sim.push(end, END, es.j, jn)

    def serve_pipe(self, sim, es: GroupEngine, x: float) -> None:
        """The pipeline's queue: at the first stage its waiting requests form one batch (fewer
        than max_batch_size); a later stage runs its oldest received batch."""
        pkv = es.pkv
        if es.j == 0:
            rids = es.queue  # (sorted by key: its head is the earliest arrival)
            bid = f"{sim.pkey[0]}/e{es.eng.id}/{es.batch_seq + es.formed + 1}"
            b = PipeBatch(rids, [pkv[rid].context for rid in rids], bid, x, sim.key0[rids[0]][0])
        else:
            b = es.queue[0]
        n = b.n
        fn = es.fns.get(n)
        if fn is None:
            fn = es.fns[n] = es.eng.decode_time_fn(es.info, n)
        end = x + fn(b.csum + n)
        if not grow_by_one_token(es, [pkv[rid] for rid in b.rids]):
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
        heappush(sim.heap, (end, END, sim.seq, es.j, b))
        sim.seq += 1


def _first(pair):
    return pair[0]
