"""Small simulated clusters shared by the simulator tests: three tiny models on a ring of three
engines, two tiny models on two engines for the CLI tests, and how two runs' results are compared."""

from __future__ import annotations

import dataclasses

from paraflex.config.schema import Config, WorkloadConfig
from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.simulator.systems.layouts import SystemLayout

TWO_TINY_MODELS_YAML = """
cluster: {num_engines: 2, device: cpu, memory_gb: 1, host_memory_gb: 0.01}
models:
  - {name: a, arch: tiny-2l}
  - {name: b, arch: tiny-4l}
scheduler: {max_batch_size: 8, block_bytes: 4096}
"""  # two tiny models on two CPU engines: the config of the simulate CLI tests

MODELS = [("a", "tiny-2l", 1), ("b", "tiny-4l", 2), ("c", "tiny-8l", 3)]  # name, arch, stages


def ring_config(memory_gb: float, policy: str, max_batch: int, workload: WorkloadConfig, **cluster) -> Config:
    """`cluster`: more keys of the cluster section (nodes, node_interconnect_*)."""
    return Config.from_dict({
        "cluster": {"num_engines": 3, "device": "cpu", "memory_gb": memory_gb, "host_memory_gb": 0.01, **cluster},
        "models": [{"name": n, "arch": a} for n, a, _ in MODELS],
        "scheduler": {"max_batch_size": max_batch, "policy": policy, "block_bytes": 4096},
        "workload": dataclasses.asdict(workload),
    })


def ring_layout(config: Config, policy: str) -> SystemLayout:
    """Every model's stages on consecutive engines of a ring of 3, model i starting at engine i;
    model `a` gets a second replica."""
    from paraflex.planner.problem import split_layers

    models, engines = {}, [EnginePlacement(e, [], 0, {}) for e in range(3)]
    for i, ((name, _, s), mc) in enumerate(zip(MODELS, config.models)):
        cuts = list(split_layers(mc.arch.num_layers, s))
        replicas = [[(i + k) % 3 for k in range(s)]]
        if name == "a":
            replicas.append([(i + 1) % 3])
        models[name] = ModelPlacement(name, mc.arch.num_layers, cuts, replicas)
        for j, route in enumerate(replicas):
            for k, e in enumerate(route):
                a, b = cuts[k]
                engines[e].stages.append(StageRef(name, j, k))
                engines[e].weight_bytes += mc.arch.stage_weight_bytes(a, b, k == 0, k == s - 1)
    return SystemLayout("ring", Placement(1, "hand", {}, 0.0, models, engines), policy, 1, config.cluster.memory_bytes)


def fingerprint(res):
    return [(r.id, r.model, r.replica, r.first_token, r.finish, r.tokens) for r in sorted(res.metrics.requests.values(), key=lambda r: r.id)]


RUN_ONLY = ("wall_s", "setup_wall_s", "sim_requests_per_wall_s", "events", "fast_forward_cycles")


def assert_same_results(fast, plain):
    assert list(fast.metrics.request_rows()) == list(plain.metrics.request_rows())
    strip = lambda s: {k: v for k, v in s.items() if k not in RUN_ONLY}  # noqa: E731
    assert strip(fast.summary) == strip(plain.summary)
    assert plain.summary["fast_forward_cycles"] == 0
