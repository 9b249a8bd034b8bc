"""Run one simulation: config + settings -> workload -> cluster -> event loop -> results.

The single entry point behind `paraflex simulate`, the sweep workers and the benches:
`simulate(config, settings)` builds the system's layout (systems.py), generates the requests
(workload/), wires the cluster (cluster.py), replays every arrival through the event loop
until the last request finishes, and returns a `SimResult` (metrics, summary, the resolved
settings to save next to the results).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from paraflex.costs.serving_terms import gateway, request_delay_s, return_path
from paraflex.errors import ParaflexError, UserError
from paraflex.simulator.core.cluster import Cluster
from paraflex.simulator.core.event_loop import EventLoop
from paraflex.planner.incremental import DEFAULT_HYSTERESIS
from paraflex.planner.replan_controller import DEFAULT_THRESHOLD, ReplanController
from paraflex.simulator.core.events import GatewayArrivalEvent, LiveTickEvent, RequestArrivalEvent
from paraflex.simulator.core.live_placement import LivePlacement
from paraflex.simulator.metrics.records import MetricsStore, model_slos
from paraflex.simulator.systems.layouts import SystemLayout, build_system
from paraflex.simulator.workload import SimRequest, WorkloadModel, generate, workload_of

Progress = Callable[[float, int, int, int], None]  # (simulated s, finished, total requests, events)



@dataclass
class SimSettings:
    """What `paraflex simulate` adds to the config. `rate` is the total request rate (req/s)
    over all models; `host_link_gbps` the host<->GPU bandwidth of one GPU for KV swaps (PCIe
    4.0 x16 ~ 256 Gbit/s; an engine of tp GPUs swaps over tp links in parallel)."""

    system: str = "paraflex"
    rate: float = 1.0
    seed: int = 0
    no_sharding: bool = False
    random_placement: bool = False
    prefill_first: bool = False
    pipeline_first: bool = False  # paraflex: multi-stage decode batches first (engine/core/policies/pipeline_first.py)
    unbounded_decode_batches: bool = False  # the paper's rule: no in-flight bound on decode batches
    paper_replication: bool = False  # the paper's Alg. 1 stop (planner.fill_engines: false)
    work_shares: bool = False  # Alg. 1's shares by weight bytes, not the paper's eq. 7 (planner.replica_shares: work)
    memory_only_placement: bool = False  # the paper's Alg. 2, no compute balance (planner.balance_compute: false)
    no_head_start: bool = False  # paraflex: ignore scheduler.head_start_s (arrival order, the paper's)
    one_prompt_prefills: bool = False  # paraflex: the paper's one prompt per prefill batch (scheduler.pack_prompts: false)
    host_link_gbps: float = 256.0
    prefill_engines: int | None = None  # aegaeon: engines in the prefill pool (default: the paper's 6:10 split)
    check_invariants: bool = False
    # fast paths with the same results: replay undisturbed decode cycles in closed form
    # (fast_forward.py), a pipeline with the one-stage replicas on its engines (joint_replay.py),
    # hand a one-stage replica its tokens without an event (cluster.py)
    fast_forward: bool = True
    # live re-planning (simulator/core/live_placement.py): re-plan every `replan_interval` s
    # (None: off) or when a model's rate moves by more than `replan_threshold`; the placement
    # changes only when the objective gains more than `replan_hysteresis`
    replan_interval: float | None = None
    replan_threshold: float = DEFAULT_THRESHOLD
    replan_hysteresis: float = DEFAULT_HYSTERESIS

    def validate(self) -> "SimSettings":
        if not 0 < self.rate < math.inf:
            raise UserError(f"--rate must be a finite number > 0 requests/s, got {self.rate:g}")
        if not 0 < self.host_link_gbps < math.inf:
            raise UserError(f"--host-link-gbps must be a finite number > 0, got {self.host_link_gbps:g}")
        if self.prefill_engines is not None and self.prefill_engines < 1:
            raise UserError(f"--prefill-engines must be >= 1, got {self.prefill_engines}")
        if self.seed < 0:
            raise UserError(f"--seed must be >= 0, got {self.seed}")
        if self.replan_interval is not None and self.system != "paraflex":
            raise UserError(f"--replan-interval re-plans with ParaFlex's planner; it applies to --system paraflex, not {self.system}")
        return self


@dataclass
class SimResult:
    system: str
    layout: SystemLayout
    metrics: MetricsStore
    summary: dict
    settings: dict = field(default_factory=dict)
    engines: list = field(default_factory=list, repr=False)  # the SimEngines, for inspection

    @property
    def placement(self):
        return self.layout.placement


def simulate(config, settings: SimSettings, layout: SystemLayout | None = None, cost=None,
             requests: list[SimRequest] | None = None, loop: EventLoop | None = None,
             progress: Progress | None = None, schedules=None, controller=None) -> SimResult:
    """Simulate `config` served by `settings.system`. `layout` skips re-planning (sweeps),
    `cost` replaces the cost model, `requests` the generated workload (tests), `loop` the
    event loop (bench/sim_speed.py's naive peer); `progress(simulated_s, finished, total,
    events)` is called between slices of simulated time (same results with or without);
    `schedules` (model -> workload.schedule.RateSchedule) make the generated rates vary over time;
    `controller` replaces the `ReplanController` a `replan_interval` run builds (bench/replan.py's oracle)."""
    settings.validate()
    wall0 = time.perf_counter()
    if layout is None:
        layout = build_system(config, settings)
    workload = workload_of(config)
    shares = workload.model_shares(config.models)
    models = [WorkloadModel(m.name, m.arch.max_context, s) for m, s in zip(config.models, shares)]
    if requests is None:
        requests, info = generate(models, workload, settings.rate, settings.seed, schedules)
    else:
        info = {"requests": len(requests), "given": True}
    metrics = MetricsStore(model_slos(config.models), layout.placement.num_engines, layout.gpus_per_engine)
    loop = loop if loop is not None else EventLoop()
    cluster = (layout.seed.cluster if layout.seed is not None else Cluster)(config, layout, settings, loop, metrics, cost)
    sim = _Sim(loop, cluster)
    shared_host = layout.seed is None and cluster.host is not None
    # The measured gateway and frontend <-> engines share: the engines see each request that
    # much after its arrival; its records keep the arrival (paraflex/costs/serving_terms.py).
    # On a shared host CPU with a fitted quiet gateway delay, the gateway's part stretches with
    # the host's demand at each arrival (events/gateway_arrival.py); the rest is the same for all.
    term = gateway(config.cluster.profile_dir)
    stretched_gateway = shared_host and term is not None and term.quiet_delay_s is not None
    if stretched_gateway:
        cluster.gateway = term
        metrics.request_delay = term.engine_path_s
    else:
        metrics.request_delay = request_delay_s(config.cluster.profile_dir)
    if metrics.request_delay:
        requests = [replace(r, arrival=r.arrival + metrics.request_delay) for r in requests]
    served = set(layout.placement.models)
    for req in requests:
        if req.model not in served:
            raise UserError(f"model {req.model!r} has requests but no stages in the {layout.name} placement")
        if stretched_gateway:
            loop.schedule(GatewayArrivalEvent(req.arrival - metrics.request_delay, req))
        else:
            loop.schedule(RequestArrivalEvent(req.arrival, req))
    if settings.replan_interval is not None:  # the fast path steps aside: every step is an event
        if controller is None:
            controller = ReplanController(config, layout.placement, settings.replan_interval, settings.replan_threshold,
                                          settings.replan_hysteresis)
        last = max((r.arrival for r in requests), default=0.0)
        cluster.live = LivePlacement(cluster, controller, config, layout.gpus_per_engine, settings.host_link_gbps, last)
        loop.schedule(LiveTickEvent(0.0))
    # ParaFlex's served return path (seed systems model none) and a CPU cluster's shared host
    # (paraflex/costs/host_cpu.py): a token's way back and an engine's step depend on the engines
    # busy before them, so such a run goes step by step (the fast path steps aside; so it does
    # for the served hop, paraflex/costs/served_hop.py, and the steps' spread, loop_fit.py, whose
    # fast-path twins would re-state them)
    back = return_path(config.cluster.profile_dir) if layout.seed is None else None
    if back is not None:
        metrics.token_delay = cluster.token_delay_fn(back)
    if shared_host:  # the requests it counts open: from their gateway arrival (the records' arrival)
        cluster.gateway_arrivals = sorted(r.arrival - metrics.request_delay for r in requests)
    if (layout.seed is None and back is None and cluster.served_hop is None and not cluster.step_spread and not shared_host
            and settings.replan_interval is None and settings.fast_forward):
        cluster.enable_fast_forward(requests)
    # Freeze the set-up objects out of the cyclic GC and pause it during the run (the loop
    # creates no reference cycles): collections over the block tables would cost run time.
    # No full collection first: it costs ~20 ms per run, and whatever garbage is frozen goes
    # back to the collector at `unfreeze`.
    setup = time.perf_counter() - wall0
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if progress is None:
            loop.run(sim)
        else:
            _run_reporting(loop, sim, progress, max((r.arrival for r in requests), default=0.0), len(requests))
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
    unfinished = [r.id for r in metrics.requests.values() if r.finish < 0]
    if unfinished:
        raise ParaflexError(f"simulation ended with {len(unfinished)} unfinished requests (first: {unfinished[0]}); "
                            "the engines stalled: a scheduler bug or KV too small for one request")
    wall = time.perf_counter() - wall0
    summary = metrics.summary()
    summary.update({
        "system": layout.name, "rate": settings.rate, "request_delay_s": metrics.request_delay, "seed": settings.seed, "workload": info,
        "simulated_s": max(loop.now, cluster.fast_path.until) if cluster.fast_path else loop.now, "events": loop.processed,
        # decode cycles the fast-forward replayed, plus decisions the joint replay replayed
        "fast_forward_cycles": cluster.fast_path.cycles if cluster.fast_path else 0,
        "wall_s": wall, "setup_wall_s": setup,
        "sim_requests_per_wall_s": len(requests) / wall if wall > 0 else None,
    })
    if cluster.live is not None:
        summary["live_replanning"] = cluster.live.stats.summary()
    resolved = {"config": config.to_dict(), "simulation": asdict(settings), "layout": layout.describe()}
    return SimResult(layout.name, layout, metrics, summary, resolved, cluster.engines)


PROGRESS_SLICES = 200  # slices of the arrival window between progress calls


def _run_reporting(loop: EventLoop, sim, progress: Progress, window: float, total: int) -> None:
    """`loop.run(sim)` in slices of simulated time, calling `progress` after each. The loop
    stops between two instants only (every event at or before the slice's end has run and
    settled), so the events run in the same order as in one call."""
    step = window / PROGRESS_SLICES if window > 0 else 1.0
    metrics = sim.cluster.metrics
    while len(loop):
        loop.run(sim, until=max(loop.now + step, loop.next_time()))
        progress(loop.now, metrics.finished, total, loop.processed)


class _Sim:
    """What event handlers see: the loop and the cluster."""

    __slots__ = ("loop", "cluster")

    def __init__(self, loop: EventLoop, cluster: Cluster):
        self.loop = loop
        self.cluster = cluster
