"""The cut of a joint replay: everything the group simulation decided, applied in bulk.

Place in the data flow: `GroupSim.apply` (joint_sim.py) calls `apply_cut` once the replay stops
(joint_replay.py, the cut); per engine it applies the metrics in time order, the requests' and
queues' states, the KV growth in decision order and the counters (`BulkAdvance.replay_*` in
engine/core/bulk_advance.py), then hands what is still running or in flight to real events
(`Cluster.hold`, `send_batch`, `send_tokens`, `start_batch`).
"""

from __future__ import annotations

from paraflex.engine.core.messages import DECODE, BatchMessage, DecodeEntry, TokenEntry, TokenMessage
from paraflex.simulator.fastpath.joint_state import ARRIVE, END, Admitted, PipeBatch, ReplicaBatch


def apply_cut(sim) -> None:
    """Apply `sim`'s replayed decisions in bulk (after `GroupSim.take`) and hand what is
    still under way to real events."""
    for es in sim.group:
        es.eng.busy = False  # (a suspended replay kept them busy; `hold` below)
        if es.started is not None:  # a one-stage batch ran: its tokens are back at once
            s = es.eng.scheduler
            s.receive_tokens(s.complete(es.started).token_message)
        _drop_last_steps(es)
    for es in sim.group:
        _apply_engine(sim, es)
    _apply_pipeline_tokens(sim)
    _hand_over(sim)
    if sim.cluster.check:
        for es in sim.group:
            es.eng.scheduler.check()


def _drop_last_steps(es) -> None:
    """The one-stage steps with last tokens running at the cut are formed for real at their
    start (`_hand_over`), not replayed: their growth goes (frees of pipeline requests that
    finished while they ran stay), with their busy interval, token time and decision."""
    for r in es.replicas:
        if r.fin is not None:
            mark = r.fin.grows_mark
            es.grows[mark:] = [g for g in es.grows[mark:] if g[0] is None]
            es.busy.pop()
            r.times.pop()
            r.formed -= 1
            es.formed -= 1
            es.d -= 1


def _apply_engine(sim, es) -> None:
    """One engine's replayed decisions: its prompts, metrics, replicas' and the pipeline's
    requests, KV growth in order, counters and queue ages."""
    metrics = sim.cluster.metrics
    model = sim.pkey[0]
    eng = es.eng
    s = eng.scheduler
    grows = es.grows
    busy = es.busy
    g = b = 0  # growth and busy intervals applied so far
    prompts = es.prompts if es.joiner is None else [es.joiner, *es.prompts]
    for jn in prompts:
        adm = jn.adm
        if adm is not None:  # added as at its arrival; its prompt formed as at its formation
            _replay_admit(s, adm)
            s.bulk.replay_grows(grows[g:adm.mark])
            jn.sb = s.bulk.replay_form_prefill(adm.key[0], jn.start, adm.d, es.batch_seq + adm.batch_seq)
            metrics.decode_steps(eng.id, busy[b:adm.busy_mark])
            g, b = adm.mark, adm.busy_mark
        metrics.batch(eng.id, jn.start, jn.end, True, 1, jn.tokens)  # its prompt, then its first
        metrics.tokens([jn.rec], jn.end)  # token (as `stage_done` records them)
        if jn.joined:
            _prefill_done(s, jn.sb)
    adm = es.admitted
    if adm is not None:  # admitted, its prompt still waiting
        _replay_admit(s, adm)
    metrics.decode_steps(eng.id, busy[b:] if b else busy)
    for r in es.replicas:
        for rids, recs, steps in r.done:
            s.bulk.replay_finish(r.key[0], rids)
            _token_steps(metrics, r, rids, recs, r.times[:steps])
        if r.formed and r.rids:
            late = r.late
            cycles = r.formed if late is None else [r.formed - late[rid].formed_before if rid in late else r.formed
                                                   for rid in r.rids]
            if late is None or any(cycles):
                s.bulk.replay_first_decode(r.key[0], r.rids, cycles, r.since, False)
        if r.times and r.rids:
            _token_steps(metrics, r, r.rids, r.recs, r.times)
    if es.j == 0:
        members = [(rid, kv.context, sim.gen0[rid], es.bid_of.get(rid)) for rid, kv in es.pkv.items()]
        s.bulk.replay_pipeline_first(model, members)
        if es.gone:
            s.bulk.replay_pipeline_gone(model, 0, es.gone)
    else:
        waiting = {rid for b in es.queue if id(b) in es.queued for rid in b.rids}
        members = [(rid, kv.context, es.pgen[rid]) for rid, kv in es.pkv.items() if rid not in waiting]
        s.bulk.replay_pipeline_later(model, es.j, members, es.served_queued)
        if es.gone:
            s.bulk.replay_pipeline_gone(model, es.j, es.gone)
        for b, d, i in es.arrivals:  # received in the replay, still waiting: received for real
            if any(b is q for q in es.queue):
                s.bulk.restore_counters(d, es.seq + i - 1)  # received as at its arrival
                s.receive_batch(_message(sim, b, es.j))
    s.bulk.replay_grows(grows[g:] if g else grows)
    s.bulk.replay_counters(es.d, es.seq + es.received, es.formed, es.promotions)
    s.bulk.replay_ages(model, es.since, [(r.key[0], r.since) for r in es.replicas])
    if prompts and not prompts[-1].joined:  # still running at the cut: done when the engine is free
        _prefill_done(s, prompts[-1].sb)


def _apply_pipeline_tokens(sim) -> None:
    """The pipeline's hops and tokens in the replay (records of requests that finished in it
    kept in `sim.gone`)."""
    metrics, records = sim.cluster.metrics, sim.cluster.records
    metrics.hops += len(sim.hops)  # (`metrics.hop` for each)
    metrics.hop_bytes += sum(sim.hops)
    gone = sim.gone
    record = records.__getitem__ if not gone else lambda rid: gone.get(rid) or records[rid]
    for b, time in sim.tokens:
        metrics.tokens([record(rid) for rid in b.rids], time)


def _hand_over(sim) -> None:
    """What is under way at the cut becomes real events: stages running end with a
    `ReplayEndEvent` (`Cluster.hold`; a one-stage step with last tokens is formed for real and
    ends with its `StageEndEvent`), their hops and tokens and the messages in flight are sent,
    and the engines that decide at the cut instant are held until then."""
    cluster, group, pkey = sim.cluster, sim.group, sim.pkey
    metrics, records = cluster.metrics, cluster.records
    for time, kind, _, j, what in sorted(sim.heap):
        es = group[j]
        if kind == END and isinstance(what, ReplicaBatch) and what.fin is not None:
            eng = es.eng  # the step with last tokens, as `schedule` forms it at its start
            start = what.fin.start
            cluster.start_batch(eng, eng.scheduler.bulk.replay_form(what.key[0], what.n, start), start, time, what.n, what.n)
        elif kind == END:
            cluster.hold(es.eng, pkey if isinstance(what, PipeBatch) else what.key, time)  # (a replica, prompt or held stage)
            if isinstance(what, PipeBatch):
                if j < sim.last:
                    nbytes, dt = sim.hop(what.n, j)
                    metrics.hop(nbytes)
                    cluster.send_batch(group[j + 1].eng, pkey, _message(sim, what, j + 1), time + dt)
                else:  # (members with their last token finish at its end: `Cluster.replay_done`)
                    fin = sim.last_tokens(what)
                    metrics.tokens([records[rid] for rid in what.rids], time)
                    cluster.send_tokens(group[0].eng, pkey, _tokens(sim, what, fin), time + sim.back)
                    es.eng.running.finished = fin
        elif kind == ARRIVE:
            cluster.send_batch(es.eng, pkey, _message(sim, what, j), time)
        else:
            cluster.send_tokens(es.eng, pkey, _tokens(sim, what, sim.last_tokens(what)), time)
    for es in sim.held:
        cluster.hold(es.eng, pkey, sim.cut)


def _message(sim, b: PipeBatch, stage: int) -> BatchMessage:
    return BatchMessage(sim.pkey[0], stage, b.bid, DECODE, [],
                        [DecodeEntry(rid, None, p) for rid, p in zip(b.rids, b.pos)], b.formed_at)


def _tokens(sim, b: PipeBatch, fin: list) -> TokenMessage:
    """The token message of b's last stage; `fin`: its members whose token is their last."""
    return TokenMessage(sim.pkey[0], b.bid, [TokenEntry(rid, None, p + 1, True, "length") if rid in fin else
                                              TokenEntry(rid, None, p + 1, False, None) for rid, p in zip(b.rids, b.pos)])


def _replay_admit(s, adm: Admitted) -> None:
    """`add_request` of a request the replay admitted, as at its arrival (after `adm.since`
    decisions, its sequence number `adm.seq`)."""
    s.bulk.restore_counters(adm.since, adm.seq - 1)
    s.add_request(adm.rid, adm.key[0], adm.prompt_len, adm.max_new, adm.arrival)


def _prefill_done(s, sb) -> None:
    """A one-stage replica's prompt batch whose end the replay took over: `complete` and its
    token back (`receive_tokens`, the first token) as at that end. (The age of the decode
    queue it joins is set by `replay_first_decode` / `replay_ages`, or, still running at the
    cut, is the decision count after `replay_counters`.)"""
    s.receive_tokens(s.complete(sb).token_message)


def _token_steps(metrics, r: ReplicaBatch, rids, recs, times) -> None:
    """`metrics.token_steps` for members of r over r's step ends `times`, each from its own
    first step (a member that joined late: `ReplicaBatch.late`)."""
    late = r.late
    if late is None:
        metrics.token_steps(recs, times)
        return
    metrics.token_steps([rec for rid, rec in zip(rids, recs) if rid not in late], times)
    for rid, rec in zip(rids, recs):
        if rid in late and late[rid].first_step < len(times):
            metrics.token_steps([rec], times[late[rid].first_step:])
