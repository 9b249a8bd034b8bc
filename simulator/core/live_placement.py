"""Live re-planning inside the simulator: the controller's actions applied to the running cluster.

Place in the data flow: runner.py gives the `Cluster` a `LivePlacement` when the run has a
`replan_interval`; the cluster tells it every arrival (`observe`) and asks it which replica a
request goes to (`pick`: serving replicas only); a `LiveTickEvent` (events/live_tick.py) calls
`tick` every `TICK_S` while arrivals last or a change is in flight. A model whose every
replica moves has none serving while the new ones load: its arrivals wait (`held`) and go to
the first replica that serves (counted in the summary's `held_requests`). The re-planning itself is
the planner's `ReplanController` (planner/replan_controller.py): the same pure code the server
runs; this module only charges time and memory for its actions.

* remove: the replica leaves the dispatcher's choices at once, finishes what it holds (drains),
  and once no request and no message of it is left its stages leave their engines' schedulers
  and its weights' memory is free;
* add: each stage waits for its engine (a drained stage of the same model must be gone: an
  engine holds one stage per model) and for memory: its weights (1/tp per GPU) take KV blocks
  as they come free; then it loads over the engine's
  host link (`stage_load_time`, loads on one engine in sequence). The replica serves only once
  every stage is loaded.
With re-planning on, each engine's block pool spans its whole memory (cluster.py) and every
replica's weights, those there at start included, are a block-pool allocation: memory a
removed replica frees becomes KV, and KV shrinks by exactly the weights a load takes. (The
scheduler's watermark and swap-in headroom are shares of the pool, so they are computed over
the whole memory in such runs; bench/replan.py runs its static peer the same way.)
Replicas get new indices ("slots") per model; a removed replica's slot stays (its records and
in-flight events name it) but takes no new request. The fast path steps aside: runs with
re-planning simulate every step as events (runner.py turns `fast_forward` off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraflex.costs.weight_load import stage_load_time
from paraflex.simulator.core.sim_engine import StageInfo

TICK_S = 0.1  # how often drains, loads and the controller are looked at
WEIGHTS = "weights"  # the block-pool group of loaded weights


@dataclass
class StageLoad:
    """One stage of a replica being added: its engine, weight blocks per GPU, progress."""

    engine: int
    stage: int
    blocks: int
    held: int = 0  # pool blocks obtained so far
    loaded_at: float | None = None  # when its transfer ends (set once memory is held)


@dataclass
class ReplicaLoad:
    model: str
    slot: int
    stages: list[StageLoad]
    started: float
    done: bool = False


@dataclass
class LiveStats:
    """What the live placement did, for the summary and the bench."""

    replans: list[dict] = field(default_factory=list)  # at, trigger, actions, moved bytes, objective
    moved_bytes: int = 0
    adds: int = 0
    removes: int = 0
    ready_s: list[float] = field(default_factory=list)  # per add: decision to serving
    held: int = 0  # requests that waited for a serving replica (their model had none for a moment)

    def summary(self) -> dict:
        return {"replans": len(self.replans), "replica_adds": self.adds, "replica_removes": self.removes,
                "moved_weight_bytes": self.moved_bytes, "held_requests": self.held,
                "add_ready_s_max": max(self.ready_s) if self.ready_s else None, "changes": self.replans}


class LivePlacement:
    """Applies `controller`'s re-plans to `cluster` (see the module docstring)."""

    def __init__(self, cluster, controller, config, tp: int, host_link_gbps: float, last_arrival: float):
        self.cluster = cluster
        self.controller = controller
        self.archs = {m.name: m.arch for m in config.models}
        self.tp = tp
        self.host_link_gbps = host_link_gbps
        self.last_arrival = last_arrival
        self.tick_s = TICK_S
        self.slots = {(m, tuple(route)): j for m, routes in cluster.replicas.items() for j, route in enumerate(routes)}
        self.serving = {m: set(range(len(routes))) for m, routes in cluster.replicas.items()}
        self.draining: list[tuple[str, int]] = []
        self.loads: list[ReplicaLoad] = []
        self.held: dict[str, list] = {}  # model -> requests waiting for a serving replica
        n = len(cluster.engines)
        self.link_free = [0.0] * n
        for (model, route), slot in self.slots.items():  # the start-up weights take their memory
            stages = controller.placement.models[model].stages
            for e, blocks in self._weight_blocks(model, stages, route):
                self._hold(cluster.engines[e], model, slot, blocks)
        self.stats = LiveStats()

    # --- what the cluster calls ------------------------------------------------------------
    def admit(self, req, t: float) -> None:
        """A new request: metered, then sent to a serving replica, or held until one serves (a
        model whose every replica moved has none while the new ones load)."""
        self.controller.observe(req.model, t)
        replica = self.cluster.dispatcher.pick(req.model, among=self.serving[req.model])
        if replica is None:
            self.held.setdefault(req.model, []).append(req)
            self.stats.held += 1
        else:
            self.cluster.dispatch(req, replica, t)

    def pending(self) -> bool:
        return bool(self.draining or self.loads or any(self.held.values()))

    def tick(self, t: float) -> bool:
        """Advance drains and loads, re-plan if due; True while another tick is needed."""
        self._finish_drains(t)
        self._advance_loads(t)
        if t <= self.last_arrival:
            replan = self.controller.maybe_replan(t)
            if replan is not None:
                self._apply(replan, t)
        return t < self.last_arrival or self.pending()

    # --- applying a change -----------------------------------------------------------------
    def _apply(self, replan, t: float) -> None:
        moved = 0
        for priced in replan.actions:
            a = priced.action
            if a.op == "remove":
                slot = self.slots.pop((a.model, a.engines))
                self.serving[a.model].discard(slot)
                loading = [load for load in self.loads if (load.model, load.slot) == (a.model, slot)]
                if loading:  # not serving yet: the load stops and gives its memory back
                    self._cancel(loading[0])
                else:
                    self.draining.append((a.model, slot))
                self.stats.removes += 1
            else:
                self._start_add(a, t)
                moved += a.weight_bytes
        self.stats.moved_bytes += moved
        self.stats.replans.append({"at": t, "trigger": replan.trigger, "actions": [p.to_dict() for p in replan.actions],
                                   "moved_bytes": moved, "objective_before": replan.objective_before,
                                   "objective_after": replan.objective_after, "rates": replan.rates})

    def _start_add(self, action, t: float) -> None:
        cl = self.cluster
        routes = cl.replicas[action.model]
        slot = len(routes)
        routes.append(list(action.engines))
        self.slots[(action.model, action.engines)] = slot
        cl.route_pending[(action.model, slot)] = []
        cl.messages[(action.model, slot)] = []
        self._grow_dispatcher()
        blocks = self._weight_blocks(action.model, action.stages, action.engines)
        self.loads.append(ReplicaLoad(action.model, slot, [StageLoad(e, k, n) for k, (e, n) in enumerate(blocks)], t))
        self.stats.adds += 1

    def _weight_blocks(self, model: str, stages, engines) -> list[tuple[int, int]]:
        """(engine, weight blocks per GPU) of each stage of a replica."""
        arch, last = self.archs[model], len(stages) - 1
        out = []
        for k, ((a, b), e) in enumerate(zip(stages, engines)):
            per_gpu = -(-arch.stage_weight_bytes(a, b, k == 0, k == last) // self.tp)
            out.append((e, -(-per_gpu // self.cluster.engines[e].block_bytes)))
        return out

    def _cancel(self, load: ReplicaLoad) -> None:
        for st in load.stages:
            self._free_weights(load.model, load.slot, st.engine)
        load.done = True
        self.loads.remove(load)

    def _free_weights(self, model: str, slot: int, e: int) -> None:
        self.cluster.engines[e].pool.release((WEIGHTS, model, slot))

    @staticmethod
    def _hold(eng, model: str, slot: int, blocks: int) -> None:
        """`blocks` more of `eng`'s pool for the weights of (model, slot)."""
        owner = (WEIGHTS, model, slot)
        alloc = eng.pool.get(owner) or eng.pool.open(owner, WEIGHTS, 1, 1)
        eng.pool.grow(alloc, alloc.num_blocks + blocks)

    def _grow_dispatcher(self) -> None:
        """A slot in the dispatcher for every new replica (counts and homes stay)."""
        cl = self.cluster
        for m, routes in cl.replicas.items():
            while len(cl.dispatcher.outstanding(m)) < len(routes):
                cl.dispatcher.add_replica(m, list(routes[len(cl.dispatcher.outstanding(m))]))

    def _advance_loads(self, t: float) -> None:
        for load in self.loads:
            for st in load.stages:
                if st.loaded_at is None:
                    self._take_memory(load, st, t)
            if all(st.loaded_at is not None and st.loaded_at <= t for st in load.stages):
                self._activate(load, t)
        self.loads = [load for load in self.loads if not load.done]

    def _take_memory(self, load: ReplicaLoad, st: StageLoad, t: float) -> None:
        eng = self.cluster.engines[st.engine]
        if load.model in eng.stages:
            return  # a draining stage of the same model is still there
        want = min(st.blocks - st.held, eng.pool.num_free)
        if want > 0:
            self._hold(eng, load.model, load.slot, want)
            st.held += want
        if st.held == st.blocks:
            start = max(t, self.link_free[st.engine])
            nbytes = st.blocks * eng.block_bytes * self.tp
            st.loaded_at = self.link_free[st.engine] = start + stage_load_time(nbytes, self.tp, self.host_link_gbps)

    def _activate(self, load: ReplicaLoad, t: float) -> None:
        cl = self.cluster
        mp = self.controller.placement.models[load.model]
        route = cl.replicas[load.model][load.slot]
        arch = self.archs[load.model]
        for st in load.stages:
            a, b = mp.stages[st.stage]
            last = st.stage == mp.num_stages - 1
            eng = cl.engines[st.engine]
            eng.stages[load.model] = StageInfo(load.model, arch, load.slot, st.stage, b - a, st.stage == 0, last,
                                               -1 if last else route[st.stage + 1], route[0])
            eng.scheduler.add_stage(load.model, st.stage, b - a, -(-arch.kv_bytes_per_token_per_layer() // self.tp),
                                    mp.num_stages)
        self.serving[load.model].add(load.slot)
        for req in self.held.pop(load.model, []):
            self.cluster.dispatch(req, self.cluster.dispatcher.pick(load.model, among=self.serving[load.model]), t)
        self.stats.ready_s.append(t - load.started)
        load.done = True

    def _finish_drains(self, t: float) -> None:
        cl = self.cluster
        still = []
        for model, slot in self.draining:
            key = (model, slot)
            if cl.dispatcher.outstanding(model)[slot] or cl.route_pending[key] or cl.messages[key]:
                still.append(key)
                continue
            for e in cl.replicas[model][slot]:
                eng = cl.engines[e]
                eng.scheduler.remove_stage(model)
                del eng.stages[model]
                self._free_weights(model, slot, e)
        self.draining = still
