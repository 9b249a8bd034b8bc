"""The config's `cluster:` section: engine count, device, TP degree, memory, interconnect.

Place in the data flow: `paraflex.config.schema` parses the section with `parse_cluster` into a
`ClusterConfig`; the planner sizes engines from its memory, and `cost_model()` /
`interconnect()` give the stage and hop times the planner, simulator and benchmarks use. The
device name is checked against paraflex.costs.devices. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from paraflex.config.fields import GIB, Section, resolve_path
from paraflex.errors import ConfigError, UserError


@dataclass
class ClusterConfig:
    num_engines: int
    device: str = "cpu"
    tp: int = 1
    memory_gb: float = 0.0  # per engine (its whole TP group), usable for weights + KV
    host_memory_gb: float = 0.0  # per engine, for swapped-out KV
    interconnect_gbps: float = 100.0  # between engines (pipeline hops)
    interconnect_latency_us: float = 10.0
    profile_dir: str | None = None  # measured per-op tables (Vidur layout) for the cost model

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIB)

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * GIB)

    def interconnect(self):
        from paraflex.costs.costmodel import Interconnect

        return Interconnect(self.interconnect_gbps * 1e9 / 8, self.interconnect_latency_us * 1e-6)

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
    if profile_dir is not None:
        given, profile_dir = profile_dir, resolve_path(profile_dir, base_dir)
        if not os.path.isdir(profile_dir):
            where = "" if given == profile_dir else (
                f" (looked up at {profile_dir}: a relative path is taken from the config's folder {base_dir})")
            raise ConfigError("cluster.profile_dir", f"{given} is not a directory{where}")
    return ClusterConfig(
        num_engines=s.int("num_engines", required=True, minimum=1),
        device=device,
        tp=tp,
        memory_gb=memory_gb,
        host_memory_gb=s.num("host_memory_gb", 0.0, nonneg=True),
        interconnect_gbps=s.num("interconnect_gbps", 100.0, positive=True),
        interconnect_latency_us=s.num("interconnect_latency_us", 10.0, nonneg=True),
        profile_dir=profile_dir,
    )
