"""The seed systems' layouts, registered in the simulator's SYSTEMS registry.

| name     | layout                                                   | engines run                         |
|----------|----------------------------------------------------------|-------------------------------------|
| aegaeon  | prefill and decode pools (6:10 by default), no model     | grouped FCFS prefill, WRR decode    |
|          | resident: weights load on demand (aegaeon_cluster.py)    | turns, token-level model switches   |
| prism    | KVPR placement (kvpr.py); models that fit nowhere start  | per-GPU Moore-Hodgson admission,    |
|          | evicted                                                  | idle eviction, on-demand activation |
| muxserve | MuxServe greedy, <= 2 models per engine, all resident    | FCFS admission, no eviction         |

A `SeedSpec` names the simulated cluster and the paper parameters; the layout's `placement`
records where models start (one stage per model, one replica per home engine) so the
simulator's outputs (placement.json, the layout summary) work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraflex.errors import UserError
from paraflex.placement import VERSION, EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.simulator.metrics.records import model_slos
from paraflex.simulator.seeds.aegaeon_cluster import AegaeonCluster
from paraflex.simulator.seeds.colocated_cluster import ColocatedCluster
from paraflex.simulator.seeds.grouped_fcfs import MAX_GPSIZE
from paraflex.simulator.seeds.kvpr import PlacedModel, kvpr_placement
from paraflex.simulator.seeds.muxserve_placement import MAX_MODELS_PER_GPU, muxserve_placement
from paraflex.simulator.seeds.switching import AEGAEON_BETA
from paraflex.simulator.seeds.wrr_quota import Q_MAX_S
from paraflex.simulator.systems.system_layout import SYSTEMS, SystemLayout
from paraflex.simulator.workload import workload_of

AEGAEON_PREFILL_SHARE = 6 / 16  # the paper's testbed: 6 prefill + 10 decode GPUs
PRISM_IDLE_S = 10.0  # idle threshold before a model may be evicted (Prism §3.1 counts idle periods > 10 s)
PRISM_TAU = 0.0  # KVPR hysteresis; the simulation places once, so it only matters to re-placement
CHUNK_TOKENS = 512  # chunked-prefill tokens per step (SGLang's and Sarathi's scale)


@dataclass
class SeedSpec:
    name: str
    cluster: type
    params: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, **self.params}


def seed_placement(config, planner: str, homes: dict[str, list[int]], params: dict) -> Placement:
    """A placement with one whole-model stage per model and a replica on each home engine."""
    engines = [EnginePlacement(i) for i in range(config.cluster.num_engines)]
    models = {}
    for m in config.models:
        home = homes.get(m.name, [])
        models[m.name] = ModelPlacement(m.name, m.arch.num_layers, [(0, m.arch.num_layers)], [[e] for e in home])
        for k, e in enumerate(home):
            engines[e].stages.append(StageRef(m.name, k, 0))
            engines[e].weight_bytes += m.arch.weight_bytes()
    return Placement(VERSION, planner, params, 0.0, models, engines)


def _layout(name: str, config, policy: str, spec: SeedSpec, homes: dict[str, list[int]]) -> SystemLayout:
    cl = config.cluster
    return SystemLayout(name, seed_placement(config, name, homes, spec.describe()), policy, cl.tp, cl.memory_bytes,
                        seed=spec)


def aegaeon_split(num_engines: int, prefill_engines: int | None) -> int:
    if num_engines < 2:
        raise UserError(f"aegaeon needs at least 2 engines (a prefill and a decode pool), the cluster has {num_engines}; "
                        "raise cluster.num_engines")
    if prefill_engines is None:
        return min(num_engines - 1, max(1, round(num_engines * AEGAEON_PREFILL_SHARE)))
    if not 1 <= prefill_engines < num_engines:
        raise UserError(f"--prefill-engines {prefill_engines}: must leave at least one engine of {num_engines} "
                        f"to each pool (1..{num_engines - 1})")
    return prefill_engines


@SYSTEMS.register("aegaeon")
def aegaeon(config, settings) -> SystemLayout:
    p = aegaeon_split(config.cluster.num_engines, settings.prefill_engines)
    spec = SeedSpec("aegaeon", AegaeonCluster, {"prefill_engines": p, "decode_engines": config.cluster.num_engines - p,
                                                 "max_group": MAX_GPSIZE, "q_max_s": Q_MAX_S, "beta": AEGAEON_BETA})
    return _layout("aegaeon", config, "grouped-fcfs+wrr", spec, {})


def _placed_models(config, settings) -> list[PlacedModel]:
    shares = workload_of(config).model_shares(config.models)
    slos = model_slos(config.models)
    return [PlacedModel(m.name, settings.rate * s, slos[m.name].ttft_s, m.arch.weight_bytes())
            for m, s in zip(config.models, shares)]


def min_kv_bytes(arch) -> int:
    """KV a model needs beside its weights on a GPU: one request of its full context."""
    return arch.max_context * arch.kv_bytes_per_token()


def _colocated_params(models: list[PlacedModel], admission: str, evict: bool) -> dict:
    return {"admission": admission, "evict": evict, "idle_s": PRISM_IDLE_S, "chunk_tokens": CHUNK_TOKENS,
            "rates": {m.name: m.rate for m in models}}


@SYSTEMS.register("muxserve")
def muxserve(config, settings) -> SystemLayout:
    models = _placed_models(config, settings)
    homes = muxserve_placement(models, config.cluster.num_engines, config.cluster.memory_bytes,
                               {m.name: min_kv_bytes(m.arch) for m in config.models})
    spec = SeedSpec("muxserve", ColocatedCluster, {**_colocated_params(models, "fcfs", False),
                                                    "max_models_per_engine": MAX_MODELS_PER_GPU})
    return _layout("muxserve", config, "fcfs+time-slicing", spec, {m: [g] for m, g in homes.items()})


@SYSTEMS.register("prism")
def prism(config, settings) -> SystemLayout:
    models = _placed_models(config, settings)
    kv_need = max(min_kv_bytes(m.arch) for m in config.models)
    homes = kvpr_placement(models, config.cluster.num_engines, config.cluster.memory_bytes, PRISM_TAU, None, kv_need)
    spec = SeedSpec("prism", ColocatedCluster, {**_colocated_params(models, "moore-hodgson", True), "tau": PRISM_TAU})
    return _layout("prism", config, "moore-hodgson+time-slicing", spec,
                   {m: [g] for m, g in homes.items() if g is not None})
