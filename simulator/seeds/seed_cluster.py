"""What every seed cluster shares: the hooks the event loop and runner.py call, request records,
token emission and the whole-model step timer.

A seed cluster stands where cluster.py's ParaFlex cluster stands: `admit(request, t)` on each
arrival (events/request_arrival.py), `settle` after each event (a no-op: seed clusters decide
at once), `engines` for inspection. Subclasses (aegaeon_cluster.py, colocated_cluster.py) add
their instances and policies; they report into the simulator's MetricsStore.
"""

from __future__ import annotations

from paraflex.costs.costmodel import CostModel
from paraflex.simulator.seeds.events import SeedEvent
from paraflex.simulator.seeds.seed_request import SeedRequest
from paraflex.simulator.seeds.step_time import ModelTimer


class SeedCluster:
    def __init__(self, config, layout, settings, loop, metrics, cost=None):
        self.loop = loop
        self.metrics = metrics
        self.woken: list = []  # the event loop's settle hook: seed clusters decide at once
        self.fast_path = None
        self.live = None  # seed systems place once: no live re-planning
        cl = config.cluster
        if cost is None:
            cost = CostModel(cl.device, tp=layout.gpus_per_engine, profile_dir=cl.profile_dir)
        self.timer = ModelTimer(cost)
        self.archs = {m.name: m.arch for m in config.models}
        self.weight_bytes = {m.name: m.arch.weight_bytes() for m in config.models}
        self.memory = layout.memory_bytes  # per engine
        # weights and KV cross the host link of every GPU of an engine in parallel
        self.link_Bps = settings.host_link_gbps * 1e9 / 8 * layout.gpus_per_engine
        self.params = layout.seed.params
        self.engines: list = []

    def settle(self, t: float, more_now: bool) -> None:
        pass

    def at(self, t: float, call, *args) -> None:
        self.loop.schedule(SeedEvent(t, call, *args))

    def weights(self, model: str | None) -> int:
        return self.weight_bytes[model] if model is not None else 0

    def new_request(self, req) -> SeedRequest:
        rec = self.metrics.add_request(req.id, req.model, req.arrival, req.prompt_len, req.output_len)
        return SeedRequest(req, self.archs[req.model], rec, self.metrics.slos[req.model].ttft_s)

    def emit(self, reqs: list[SeedRequest], t: float) -> list[SeedRequest]:
        """One token for each of `reqs` at t; returns those that are now finished."""
        self.metrics.tokens([r.rec for r in reqs], t)
        done = []
        for r in reqs:
            r.generated += 1
            if r.done:
                self.metrics.finish(r.rec, t)
                done.append(r)
        return done
