"""Config schema and loader: YAML/JSON file -> validated, resolved `Config` dataclasses.

Place in the data flow: every command (`paraflex plan`, `serve`, `simulate`, benches) starts
with `load_config(path)`. The result holds resolved `ModelArch`es (built-in name, HF
``config.json`` or GGUF header), the cluster, planner, scheduler and workload settings. Every
mistake raises `ConfigError(path, reason)` with the field path (``models[2].rate``) and the
fix. `Config.to_dict()` gives a plain dict that `Config.from_dict` reads back unchanged (saved
next to results). The full key reference is docs/config.md.

This module holds the top level (`Config`, the loader); each section's dataclass and parser
live beside it, one module per section: paraflex/config/cluster.py, models.py, planner.py,
scheduler.py, workload.py (their dataclasses are re-exported here). The typed, path-aware
field reader shared by all sections is paraflex/config/fields.py; reading the file itself
(YAML/JSON, duplicate keys refused) is paraflex/config/file.py.

Units: humans write GiB (``memory_gb``, 2**30 bytes), Gbit/s, microseconds and milliseconds;
the dataclasses keep those numbers and offer byte/second accessors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from paraflex.config.cluster import ClusterConfig, parse_cluster
from paraflex.config.fields import GIB, Section
from paraflex.config.file import read_config_file
from paraflex.config.models import ModelConfig, check_models, parse_model
from paraflex.config.planner import PlannerConfig, parse_planner
from paraflex.config.scheduler import POLICIES, SchedulerConfig, check_head_starts, parse_scheduler
from paraflex.config.workload import WorkloadConfig, parse_workload
from paraflex.errors import ConfigError, UserError

__all__ = ["GIB", "POLICIES", "ClusterConfig", "Config", "ModelConfig", "PlannerConfig",
           "SchedulerConfig", "WorkloadConfig", "load_config"]


@dataclass
class Config:
    cluster: ClusterConfig
    models: list[ModelConfig]
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig | None = None
    name: str | None = None
    source: str = "<dict>"  # where it came from (file path), for messages

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise UserError(f"no model named {name!r} in {self.source}; models: {[m.name for m in self.models]}")

    @staticmethod
    def from_dict(d: dict, source: str = "<dict>", base_dir: str | None = None) -> "Config":
        return _parse_config(d, source, base_dir or os.getcwd())

    def to_dict(self) -> dict:
        out: dict = {}
        if self.name is not None:
            out["name"] = self.name
        out["cluster"] = _asdict(self.cluster, drop_none=True)
        zipf = self.workload is not None and self.workload.zipf_alpha is not None
        out["models"] = [m.to_dict(with_rate=not zipf) for m in self.models]
        out["planner"] = _asdict(self.planner)
        out["scheduler"] = _asdict(self.scheduler, drop_none=True)
        if self.workload is not None:
            out["workload"] = _asdict(self.workload, drop_none=True)
        return out


def _asdict(obj, drop_none: bool = False) -> dict:
    d = {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    return {k: v for k, v in d.items() if not (drop_none and v is None)}


def load_config(path: str) -> Config:
    """Read a YAML (.yaml/.yml) or JSON (.json) config file and validate it."""
    return _parse_config(read_config_file(path), path, os.path.dirname(os.path.abspath(path)))


def _parse_config(data, source: str, base_dir: str) -> Config:
    if data is None:
        raise ConfigError("", f"{source} is empty; it needs at least `cluster:` and `models:`")
    top = Section(data, "", ("name", "cluster", "models", "planner", "scheduler", "workload"))
    if not top.has("cluster"):
        raise ConfigError("cluster", "missing required section (num_engines, device, tp, memory_gb, ...)")
    cluster = parse_cluster(data["cluster"], base_dir)
    models_raw = data.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("models", "expected a non-empty list of model entries")
    models = [parse_model(m, f"models[{i}]", base_dir) for i, m in enumerate(models_raw)]
    check_models(models, cluster)
    planner = parse_planner(data.get("planner") or {})
    scheduler = parse_scheduler(data.get("scheduler") or {})
    check_head_starts(scheduler, (m.name for m in models))
    workload = parse_workload(data["workload"], base_dir) if top.has("workload") else None
    if workload is not None and workload.zipf_alpha is not None:
        explicit = [i for i, m in enumerate(models_raw) if isinstance(m, dict) and "rate" in m]
        if explicit:
            raise ConfigError(
                f"models[{explicit[0]}].rate",
                "workload.zipf_alpha sets every model's rate from its position in the list; "
                "remove the per-model rate or the zipf_alpha",
            )
        workload.write_zipf_rates(models)
    return Config(cluster, models, planner, scheduler, workload, top.str("name"), source)
