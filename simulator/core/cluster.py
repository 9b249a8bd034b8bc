"""The simulated cluster: engines wired by the placement, a gateway dispatcher, and the
handlers the events call.

The fast path (same results, simulator/fastpath/) sits behind one hook, a `FastPath`: offered
each batch an engine forms (`wakeup`) and told of each new request (`admit`), it replays what
the engines' policy allows in closed form. Its joint replay takes over stage-end and message
events of its group (`take_over`, `take_message`), hands back what runs at its cut (`hold`,
`send_batch`, `send_tokens`), and ends the stages it held (`replay_done`).

Built by runner.py from a `SystemLayout` (systems.py). Request flow, as in the real system
(paper §3, §5, §6): the gateway sends a request to a replica by the config's dispatch rule
(the engine core's dispatcher: home-first or least outstanding); the first-stage engine's scheduler forms batches;
each finished stage forwards its batch message to the next stage's engine after the hop time
(hidden + residual bytes over the link between the two engines, inside a node or between
nodes: `Topology`, paraflex/costs/topology.py, overlapping compute); the last stage emits one
token per request, sends the tokens back to the first stage (metadata only: that link's
latency; where the profile fitted the served hop, paraflex/costs/served_hop.py, its latencies
stretched by the shared host CPU) and frees finished requests' KV on every stage. Engines decide what to run with the
engine core's scheduler; this module only moves messages and adds time. On a `device: cpu`
cluster whose profile fitted a shared host CPU (paraflex/costs/host_cpu.py) every stage execution
is stretched by the engines busy in the window before it (the fast path then steps aside).
"""

from __future__ import annotations

import random
from bisect import bisect_right

from paraflex.costs.costmodel import CostModel
from paraflex.costs.host_cpu import busy_engines
from paraflex.costs.latency_spread import spread_ratio
from paraflex.costs.serving_terms import engine_loop, host_cpu, served_hop
from paraflex.costs.topology import Topology
from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.engine.core.scheduler import EngineScheduler
from paraflex.simulator.core.events import BatchArrivalEvent, EngineWakeupEvent, ReplayEndEvent, StageEndEvent, TokenArrivalEvent
from paraflex.simulator.core.sim_engine import SimEngine, StageInfo
from paraflex.simulator.fastpath.hook import FastPath


class Cluster:
    """Every simulated engine of one layout, the dispatcher, and the event handlers."""

    def __init__(self, config, layout, settings, loop, metrics, cost=None):
        """`cost` replaces the cluster's CostModel (tests use fixed stage times)."""
        self.loop = loop
        self.metrics = metrics
        self.check = settings.check_invariants
        self.local_tokens_direct = settings.fast_forward  # see _emit_tokens
        placement = layout.placement
        cl, sc = config.cluster, config.scheduler
        # hop links by node; a layout of other engines than the config's (the `tensor` baseline's
        # one engine of every device) has no hops between engines: one node
        self.topology = (cl.topology() if len(placement.engines) == cl.num_engines
                         else Topology.one_node(len(placement.engines), cl.interconnect()))
        archs = {m.name: m.arch for m in config.models}
        if cost is None:
            cost = CostModel(cl.device, tp=layout.gpus_per_engine, profile_dir=cl.profile_dir)
        tp = layout.gpus_per_engine
        swap_Bps = settings.host_link_gbps * 1e9 / 8  # per GPU: each GPU swaps its own shard
        host_bytes = cl.host_memory_bytes
        # The served engines' options (CPU engines pack prompts), with the layout's policy and
        # its Sarathi chunk size where it sets one.
        options = {**sc.engine_options(on_cpu=cl.device == "cpu"), "policy": layout.policy}
        if layout.prefill_token_budget:
            options["prefill_token_budget"] = layout.prefill_token_budget
        if layout.decode_batches_in_flight is not None:
            options["decode_batches_in_flight"] = layout.decode_batches_in_flight
        if layout.prefill_max_requests is not None:
            options["prefill_max_requests"] = layout.prefill_max_requests
        if layout.head_start_s is not None:
            options["head_start_s"] = layout.head_start_s
        self.engines: list[SimEngine] = []
        for ep in placement.engines:
            # One pool per GPU of the TP group, all in lock-step: each GPU holds 1/tp of every
            # layer's KV heads, so the engine's accounting is one GPU's pool with 1/tp of the
            # per-token KV bytes (blocks are `block_bytes` on each GPU, as on a real worker).
            kv_bytes = max(0, layout.memory_bytes - ep.weight_bytes) // tp
            if settings.replan_interval is not None:  # weights come and go: the pool spans the memory and
                kv_bytes = layout.memory_bytes // tp  # holds them as allocations (live_placement.py)
            pool = BlockPool.from_bytes(kv_bytes, sc.block_bytes, host_bytes // tp)
            scheduler = EngineScheduler(pool, engine_id=ep.id, **options)
            stages: dict[str, StageInfo] = {}
            for ref in ep.stages:
                mp = placement.models[ref.model]
                a, b = mp.stages[ref.stage]
                route = mp.replicas[ref.replica]
                last = ref.stage == mp.num_stages - 1
                arch = archs[ref.model]
                stages[ref.model] = StageInfo(ref.model, arch, ref.replica, ref.stage, b - a,
                                              ref.stage == 0, last, -1 if last else route[ref.stage + 1], route[0])
                scheduler.add_stage(ref.model, ref.stage, b - a, -(-arch.kv_bytes_per_token_per_layer() // tp), mp.num_stages)
            self.engines.append(SimEngine(ep.id, scheduler, pool, cost, stages, swap_Bps))
        self.replicas = {name: mp.replicas for name, mp in placement.models.items()}
        self.dispatcher = Dispatcher.from_placement(placement, config, cost)
        self.records: dict[str, object] = {}
        # times of the heap events of each (model, replica): the decode fast-forward's horizon
        self.route_pending: dict[tuple[str, int], list[float]] = {
            (name, rho): [] for name, routes in self.replicas.items() for rho in range(len(routes))}
        # the batch and token messages in flight of each (model, replica): the joint replay takes them over
        self.messages: dict[tuple[str, int], list] = {key: [] for key in self.route_pending}
        self.woken: list[SimEngine] = []
        self.fast_path: FastPath | None = None
        self.live = None  # a LivePlacement (live_placement.py) when the run re-plans
        # a `device: cpu` cluster's shared host CPU (paraflex/costs/host_cpu.py; None: engines are
        # independent devices): every stage execution stretches with the engines busy before it
        self.host = host_cpu(cl)
        self.gateway_arrivals: list[float] = []  # sorted; the runner sets them where `host` counts open requests
        self.gateway = None  # a GatewayTerm whose delay `host` stretches (the runner sets it; None: a constant delay)
        # the served hand-overs between engines of one node (paraflex/costs/served_hop.py; None: the link's latency)
        self.served_hop = served_hop(cl.profile_dir)
        # how the served steps spread around their predicted time ("prefill" / "decode":
        # paraflex/costs/loop_fit.py, `step_spreads`; empty: every stage execution as predicted)
        loop = engine_loop(cl.profile_dir)
        self.step_spread = loop.step_spread if loop is not None else {}
        # quantiles for the served latencies' and steps' spreads (paraflex/costs/latency_spread.py), seeded: a run repeats
        self.draw = random.Random(settings.seed).random

    def enable_fast_forward(self, requests) -> None:
        """Replay in closed form what the engines' policy allows (simulator/fastpath/hook.py);
        `requests` are all the run's requests, whose arrival times bound each replay."""
        self.fast_path = FastPath(self, requests)

    # --- helpers ------------------------------------------------------------------------
    def _wake(self, eng: SimEngine, t: float) -> None:
        """Ask `eng` to decide once everything at this instant has been delivered: the loop
        calls `settle` after each event (see there)."""
        if not eng.busy and not eng.wake_pending:
            eng.wake_pending = True
            self.woken.append(eng)

    def settle(self, t: float, more_now: bool) -> None:
        """After an event: if more events happen at this instant, the woken engines decide
        after them (wake-up events, lowest priority); otherwise they decide now, which is
        the same order without the events."""
        woken, self.woken = self.woken, []
        if more_now:
            for eng in woken:
                self.loop.schedule_last(EngineWakeupEvent(t, eng))
        else:
            for eng in woken:
                self.wakeup(eng, t)

    # --- event handlers -------------------------------------------------------------------
    def admit(self, req, t: float) -> None:
        rec = self.metrics.add_request(req.id, req.model, req.arrival, req.prompt_len, req.output_len)
        self.records[str(req.id)] = rec
        if self.live is None:
            self.dispatch(req, self.dispatcher.pick(req.model), t)
        else:  # live re-planning: its meter sees the arrival, a serving replica takes it (or it waits for one)
            self.live.admit(req, t)

    def dispatch(self, req, replica: int, t: float) -> None:
        """Send admitted request `req` to `replica`'s first-stage engine at t."""
        self.records[str(req.id)].replica = replica
        route = self.replicas[req.model][replica]
        if self.fast_path is not None and self.fast_path.arrival(req, replica, route, t):
            return  # admitted by a replay waiting for it (added to its engine's scheduler at the cut)
        eng = self.engines[route[0]]
        eng.scheduler.add_request(str(req.id), req.model, req.prompt_len, req.output_len, t)
        self._wake(eng, t)

    def wakeup(self, eng: SimEngine, t: float) -> None:
        eng.wake_pending = False
        if eng.busy:
            return
        sb = eng.scheduler.schedule(t)
        if sb is None:
            return
        if self.fast_path is not None:
            now = self.fast_path.offer(eng, sb, t)
            if now is None:  # replayed: the engines run on from the replay's end
                return
            sb, t = now
        swapped = len(sb.swap_out) + len(sb.swap_in)
        if swapped:
            self.metrics.swap(len(sb.swap_out) * eng.block_bytes, len(sb.swap_in) * eng.block_bytes)
        run, decodes, tokens = eng.batch_time(eng.stages[sb.model], sb)
        if self.host is not None:  # the other engines' recent work and the open requests share the host's cores
            run *= self.host_stretch(t, eng)
        if self.step_spread:  # the served steps' spread around their predicted time
            run *= spread_ratio(self.step_spread.get("decode" if decodes else "prefill", []), self.draw())
        self.start_batch(eng, sb, t, t + eng.swap_time(swapped) + run, decodes, tokens)

    def start_batch(self, eng: SimEngine, sb, t: float, end: float, decodes: int, tokens: int) -> None:
        """`eng` executes `sb` (`decodes` decode requests, `tokens` new tokens) from t to `end`."""
        eng.busy = True
        eng.pending.append(end)
        self.route_pending[(sb.model, eng.stages[sb.model].replica)].append(end)
        eng.running = ev = StageEndEvent(end, eng, sb, t, decodes, tokens)
        self.loop.schedule(ev)

    def stage_done(self, eng: SimEngine, sb, start: float, t: float, decodes: int, tokens: int) -> None:
        eng.busy = False
        eng.running = None
        info = eng.stages[sb.model]
        eng.pending.remove(t)
        self.route_pending[(sb.model, info.replica)].remove(t)
        self.metrics.batch(eng.id, start, t, decodes == 0, len(sb.requests), tokens)
        done = eng.scheduler.complete(sb)
        if not info.last:
            nbytes = CostModel.hidden_bytes(info.arch, tokens)
            self.metrics.hop(nbytes)
            nxt = self.engines[info.next_engine]
            at = t + self.hop_s(eng.id, nxt.id, nbytes, t)
            self.send_batch(nxt, (sb.model, info.replica), sb.message, at)
        else:
            self._emit_tokens(eng, info, done, t)
        if self.check:
            eng.scheduler.check()
        self._wake(eng, t)

    def replay_done(self, eng: SimEngine, key: tuple[str, int], t: float, finished) -> None:
        """A stage the joint replay accounted for ends (events/replay_end.py): the requests whose
        last token it produced finish (as `complete` and `_emit_tokens` finish them; their tokens
        are on their way already), and the engine is free."""
        if finished:
            for rid in finished:
                eng.scheduler.free(rid)
            self.finish_requests(key, finished, t)
        eng.busy = False
        eng.running = None
        eng.pending.remove(t)
        self.route_pending[key].remove(t)
        self._wake(eng, t)

    def hold(self, eng: SimEngine, key: tuple[str, int], end: float) -> None:
        """The joint replay leaves `eng` executing a stage of `key` until `end` (already
        accounted for): busy, with a `ReplayEndEvent` at `end`."""
        eng.busy = True
        eng.pending.append(end)
        self.route_pending[key].append(end)
        eng.running = ev = ReplayEndEvent(end, eng, key)
        self.loop.schedule(ev)

    def take_over(self, eng: SimEngine) -> None:
        """The joint replay accounts for the stage `eng` executes: its StageEndEvent (or
        ReplayEndEvent) does nothing."""
        ev = eng.running
        if isinstance(ev, ReplayEndEvent):
            key = ev.key
            ev.key = None
        else:
            key = (ev.batch.model, eng.stages[ev.batch.model].replica)
            ev.batch = None
        eng.pending.remove(ev.time)
        self.route_pending[key].remove(ev.time)
        eng.running = None
        eng.busy = False

    def hop_s(self, src: int, dst: int, nbytes: int, t: float) -> float:
        """A batch's hidden state of `nbytes` leaving engine `src` for `dst` at t: the link's
        transfer time, its latency the served hop's (stretched by the shared host CPU) where the
        profile fitted one and the engines share a node."""
        base = self.topology.hop_time(src, dst, nbytes)
        if not self._served_between(src, dst):
            return base
        return base - self.topology.intra.latency_s + self.served_hop.hop_latency_s(self._stretch(t), self.draw())

    def token_message_s(self, last: int, first: int, t: float) -> float:
        """A token message from last-stage engine `last` to first-stage engine `first` sent at t:
        the link's latency, or the served one (stretched) as in `hop_s`."""
        if not self._served_between(last, first):
            return self.topology.link(last, first).latency_s
        return self.served_hop.token_message_s(self._stretch(t), self.draw())

    def _served_between(self, a: int, b: int) -> bool:
        """Whether a hand-over from engine a to b takes the served hop: one was fitted, and they share a node."""
        return self.served_hop is not None and self.topology.node_of[a] == self.topology.node_of[b]

    def _stretch(self, t: float) -> float:
        return 1.0 if self.host is None else self.host_stretch(t)

    def host_stretch(self, t: float, engine: SimEngine | None = None) -> float:
        """How much the shared host CPU stretches work beginning at t: by the engines executing
        over its window before t (for a step of `engine`: that engine plus the others) and the
        requests open at t."""
        busy = self.engines_busy_before(t, engine) + (1.0 if engine is not None else 0.0)
        return self.host.stretch(busy, self.in_flight(t))

    def engines_busy_before(self, t: float, exclude: SimEngine | None = None) -> float:
        """The mean number of engines (but `exclude`) executing over the host's window before t:
        finished batches (the metrics' timeline, measured as the fits measure the served step log:
        paraflex/costs/host_cpu.py) and running ones."""
        window_s, busy = self.host.window_s, self.metrics.busy
        total = busy_engines((busy[e.id] for e in self.engines if e is not exclude), t, window_s)
        t0 = t - window_s
        return total + sum(max(0.0, t - max(e.running.start, t0)) for e in self.engines
                           if e.running is not None and e is not exclude) / window_s

    def in_flight(self, t: float) -> int:
        """Requests open at t: arrived at the gateway, not finished."""
        return bisect_right(self.gateway_arrivals, t) - self.metrics.finished

    def gateway_delay_s(self, t: float) -> float:
        """The gateway's delay for a request arriving at t: its quiet latency stretched by the
        shared host CPU over the engines busy before t and the requests open at t."""
        return self.gateway.delay_s_at(self.host_stretch(t), self.draw())

    def token_delay_fn(self, term):
        """The way back of a token produced at t (`term`: a ReturnPathTerm): its latency, stretched
        by the shared host CPU over the engines busy before t and the requests open at t where the
        cluster has one."""
        return lambda t: term.delay_s(self._stretch(t), self.draw())

    def _emit_tokens(self, eng: SimEngine, info: StageInfo, done, t: float) -> None:
        """Last stage: record the tokens, free finished requests on the middle stages (the
        last stage freed them in complete(), the first stage frees them when the token
        message arrives) and send the tokens to the first stage."""
        records = self.records
        self.metrics.tokens([records[entry.req_id] for entry in done.token_message.entries], t)
        if done.finished:
            self.finish_requests((info.model, info.replica), done.finished, t)
        first = self.engines[info.first_engine]
        if first is eng and self.local_tokens_direct:
            # A one-stage replica: the tokens are back at this instant. Step by step they would
            # arrive in a TokenArrivalEvent after this instant's other stage ends and batch
            # arrivals; none of those changes what receive_tokens does here or what this engine
            # decides (it decides after all of them), so the results are the same. (If another
            # stage end frees KV here at this instant, the freed blocks go back to the free list
            # in the other order: later block ids may differ, no result depends on them.)
            eng.scheduler.receive_tokens(done.token_message)
            return
        delay = 0.0 if first is eng else self.token_message_s(eng.id, first.id, t)
        self.send_tokens(first, (info.model, info.replica), done.token_message, t + delay)

    def finish_requests(self, key: tuple[str, int], req_ids: list[str], t: float) -> None:
        """Requests of replica `key` produced their last token at t on its last stage: records,
        the dispatcher's counts, and their KV freed on the middle stages (the last stage freed
        it in `complete`, the first frees it when the token message arrives)."""
        records, metrics, done = self.records, self.metrics, self.dispatcher.done
        for rid in req_ids:
            metrics.finish(records.pop(rid), t)
            done(*key)
        for eid in self.replicas[key[0]][key[1]][1:-1]:
            e = self.engines[eid]
            for rid in req_ids:
                e.scheduler.free(rid)
            self._wake(e, t)

    def send_batch(self, eng: SimEngine, key: tuple[str, int], message, at: float) -> None:
        """A batch message reaches `eng` at `at` (a `BatchArrivalEvent`)."""
        self._deliver(eng, key, BatchArrivalEvent(at, eng, message))

    def send_tokens(self, eng: SimEngine, key: tuple[str, int], message, at: float) -> None:
        """A token message reaches the first stage `eng` at `at` (a `TokenArrivalEvent`)."""
        self._deliver(eng, key, TokenArrivalEvent(at, eng, message))

    def _deliver(self, eng: SimEngine, key: tuple[str, int], ev) -> None:
        """Schedule message event `ev` for `eng`, counted as in flight on `eng` and on replica `key`."""
        eng.pending.append(ev.time)
        self.route_pending[key].append(ev.time)
        self.messages[key].append(ev)
        self.loop.schedule(ev)

    def take_message(self, ev) -> None:
        """The joint replay accounts for a message in flight: its event does nothing."""
        key = (ev.message.model, ev.engine.stages[ev.message.model].replica)
        ev.engine.pending.remove(ev.time)
        self.route_pending[key].remove(ev.time)
        self.messages[key].remove(ev)
        ev.message = None

    def _delivered(self, key: tuple[str, int], message) -> None:
        lst = self.messages[key]
        for i, ev in enumerate(lst):
            if ev.message is message:
                del lst[i]
                return

    def deliver_batch(self, eng: SimEngine, message, t: float) -> None:
        key = (message.model, eng.stages[message.model].replica)
        eng.pending.remove(t)
        self.route_pending[key].remove(t)
        self._delivered(key, message)
        eng.scheduler.receive_batch(message)
        self._wake(eng, t)

    def deliver_tokens(self, eng: SimEngine, tokens, t: float) -> None:
        key = (tokens.model, eng.stages[tokens.model].replica)
        eng.pending.remove(t)
        self.route_pending[key].remove(t)
        self._delivered(key, tokens)
        eng.scheduler.receive_tokens(tokens)
        self._wake(eng, t)
