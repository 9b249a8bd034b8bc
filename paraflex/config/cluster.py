"""The config's `cluster:` section: engine count, device, TP degree, memory, nodes, interconnects.

Place in the data flow: `paraflex.config.schema` parses the section with `parse_cluster` into a
`ClusterConfig`; the planner sizes engines from its memory, and `cost_model()` /
`topology()` give the stage and hop times the planner, simulator and benchmarks use. The
device name is checked against paraflex.costs.devices. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from paraflex.config.fields import GIB, Section, resolve_path
from paraflex.errors import ConfigError, UserError
from paraflex.shipped import SHIPPED_PROFILES, profiles_path


@dataclass
class ClusterConfig:
    num_engines: int
    device: str = "cpu"
    tp: int = 1
    memory_gb: float = 0.0  # per engine (its whole TP group), usable for weights + KV
    host_memory_gb: float = 0.0  # per engine, for swapped-out KV
    interconnect_gbps: float = 100.0  # between engines (pipeline hops)
    interconnect_latency_us: float = 10.0
    nodes: tuple[int, ...] | None = None  # engines per node, node by node (None: one node)
    node_interconnect_gbps: float | None = None  # between nodes (None: interconnect_gbps)
    node_interconnect_latency_us: float | None = None  # (None: interconnect_latency_us)
    profile_dir: str | None = None  # measured per-op tables (Vidur layout) for the cost model

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIB)

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * GIB)

    def interconnect(self):
        """The link between engines of one node: the Ray hop `paraflex profile` measured when
        profile_dir has one (paraflex/costs/serving_terms.py), else interconnect_gbps/latency_us."""
        from paraflex.costs.interconnect import Interconnect
        from paraflex.costs.serving_terms import measured_hop

        hop = measured_hop(self.profile_dir)
        if hop is not None:
            return hop.link()
        return Interconnect(self.interconnect_gbps * 1e9 / 8, self.interconnect_latency_us * 1e-6)

    def topology(self):
        """Which node each engine is on, and the links inside and between nodes."""
        from paraflex.costs.interconnect import Interconnect
        from paraflex.costs.topology import Topology

        inter = Interconnect(_or(self.node_interconnect_gbps, self.interconnect_gbps) * 1e9 / 8,
                             _or(self.node_interconnect_latency_us, self.interconnect_latency_us) * 1e-6)
        return Topology(self.nodes or (self.num_engines,), self.interconnect(), inter)

    def cost_model(self):
        """The cost model of one engine of this cluster."""
        from paraflex.costs.costmodel import CostModel

        return CostModel(self.device, tp=self.tp, profile_dir=self.profile_dir)


def parse_cluster(raw, base_dir: str) -> ClusterConfig:
    from paraflex.costs.devices import get_device

    s = Section(raw, "cluster", tuple(ClusterConfig.__dataclass_fields__))
    device_name = s.str("device", "cpu")
    try:
        spec = get_device(device_name)
    except UserError as exc:
        raise ConfigError("cluster.device", str(exc)) from None
    device = spec.name
    tp = s.int("tp", 1, minimum=1)
    default_mem = round(0.9 * spec.memory_bytes * tp / GIB, 3)
    memory_gb = s.num("memory_gb", default_mem, positive=True)
    if device != "cpu" and memory_gb > spec.memory_bytes * tp / GIB * 1.0001:
        raise ConfigError(
            "cluster.memory_gb",
            f"{memory_gb:g} GiB exceeds what {tp} x {device} hold ({spec.memory_bytes * tp / GIB:g} GiB); lower it",
        )
    profile_dir = s.str("profile_dir")
    if profile_dir == SHIPPED_PROFILES:
        profile_dir = profiles_path()
    elif profile_dir is not None:
        given, profile_dir = profile_dir, resolve_path(profile_dir, base_dir)
        if not os.path.isdir(profile_dir):
            where = "" if given == profile_dir else (
                f" (looked up at {profile_dir}: a relative path is taken from the config's folder {base_dir})")
            raise ConfigError("cluster.profile_dir", f"{given} is not a directory{where}")
    num_engines = s.int("num_engines", required=True, minimum=1)
    return ClusterConfig(
        num_engines=num_engines,
        device=device,
        tp=tp,
        memory_gb=memory_gb,
        host_memory_gb=s.num("host_memory_gb", 0.0, nonneg=True),
        interconnect_gbps=s.num("interconnect_gbps", 100.0, positive=True),
        interconnect_latency_us=s.num("interconnect_latency_us", 10.0, nonneg=True),
        nodes=_parse_nodes(s, num_engines),
        node_interconnect_gbps=s.num("node_interconnect_gbps", positive=True),
        node_interconnect_latency_us=s.num("node_interconnect_latency_us", nonneg=True),
        profile_dir=profile_dir,
    )


def _or(value, default):
    return default if value is None else value


def _parse_nodes(s: Section, num_engines: int) -> tuple[int, ...] | None:
    """`nodes: N` (num_engines split evenly) or `nodes: [k0, k1, ...]` (engines per node)."""
    raw = s.data.get("nodes")
    if raw is None:
        return None
    if isinstance(raw, (list, tuple)):  # (to_dict writes the tuple it holds)
        if not raw or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in raw):
            raise ConfigError(s.at("nodes"), f"expected engines per node as positive integers, e.g. [4, 4], got {raw!r}")
        if sum(raw) != num_engines:
            raise ConfigError(s.at("nodes"), f"{raw} adds up to {sum(raw)} engines but num_engines is {num_engines}; "
                              "make them agree")
        return tuple(raw)
    count = s.int("nodes", minimum=1)
    if num_engines % count:
        raise ConfigError(s.at("nodes"), f"{count} nodes do not split {num_engines} engines evenly; give engines "
                          f"per node as a list (e.g. [{num_engines // count + 1}, ...]) or another count")
    return (num_engines // count,) * count
