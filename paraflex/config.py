"""Config schema and loader: YAML/JSON file -> validated, resolved `Config` dataclasses.

Place in the data flow: every command (`paraflex plan`, `serve`, `simulate`, benches) starts
with `load_config(path)`. The result holds resolved `ModelArch`es (built-in name, HF
``config.json`` or GGUF header), the cluster, planner, scheduler and workload settings. Every
mistake raises `ConfigError(path, reason)` with the field path (``models[2].rate``) and the
fix. `Config.to_dict()` gives a plain dict that `Config.from_dict` reads back unchanged (saved
next to results). The full key reference is docs/config.md. The `workload:` section's
dataclass and parser live in paraflex/workload_config.py (`WorkloadConfig` is re-exported
here); the typed, path-aware field reader shared by all sections is paraflex/config_fields.py;
reading the file itself (YAML/JSON, duplicate keys refused) is paraflex/config_file.py.

Units: humans write GiB (``memory_gb``, 2**30 bytes), Gbit/s, microseconds and milliseconds;
the dataclasses keep those numbers and offer byte/second accessors.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, dataclass, field

from paraflex import arch_files, catalog
from paraflex.catalog import ModelArch
from paraflex.config_fields import Section, resolve_path, value_kind
from paraflex.config_file import read_config_file
from paraflex.errors import ConfigError, UserError
from paraflex.workload_config import WorkloadConfig, _parse_workload

GIB = 2**30
POLICIES = ("full-batch-first", "prefill-first", "sarathi")
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MS_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:ms)?$")
_STAGE_TIME_RE = re.compile(r"^(x|/)\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)$", re.IGNORECASE)
# ModelArch fields by type, for an inline `arch:` mapping and the checks of every model.
_ARCH_INTS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "max_context", "dtype_bytes")
_ARCH_FLOATS = ("rope_theta", "rms_norm_eps")
_ARCH_FLAGS = ("tie_embeddings", "qkv_bias", "gated_mlp", "linear_bias", "parallel_block")


# ---------------------------------------------------------------------------------------
# dataclasses
# ---------------------------------------------------------------------------------------
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
        from paraflex.costmodel import Interconnect

        return Interconnect(self.interconnect_gbps * 1e9 / 8, self.interconnect_latency_us * 1e-6)

    def cost_model(self):
        """The cost model of one engine of this cluster."""
        from paraflex.costmodel import CostModel

        return CostModel(self.device, tp=self.tp, profile_dir=self.profile_dir)


@dataclass
class ModelConfig:
    name: str
    arch: ModelArch
    rate: float = 1.0  # relative arrival rate (demand share)
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    source: str | None = None  # built-in name, HF directory or GGUF path (weights at serve time)
    source_kind: str = "builtin"  # "builtin" | "hf" | "gguf"


@dataclass
class PlannerConfig:
    target_stage_time: str | float = "auto"  # "auto" | ms | "x2" | "/2"
    kappa_gb: float = 0.1  # minimum KV bytes per stage (GiB)
    ring: bool = False
    # replicate the other models while any fits when the one Alg. 1 chose cannot get another
    # replica; False is the paper's rule (stop there). planner/replication.py
    fill_engines: bool = True

    @property
    def kappa_bytes(self) -> int:
        return int(self.kappa_gb * GIB)

    def resolve_target_stage_time(self, auto_s: float) -> float:
        """T_s in seconds given the `auto` value (execution time of the smallest model)."""
        ts = self.target_stage_time
        if isinstance(ts, (int, float)):
            return float(ts) / 1000.0
        if ts == "auto":
            return auto_s
        op, num = _STAGE_TIME_RE.match(ts).groups()
        return auto_s * float(num) if op.lower() == "x" else auto_s / float(num)


@dataclass
class SchedulerConfig:
    max_batch_size: int = 32
    block_bytes: int = 32768
    policy: str = "full-batch-first"
    # None: one request per prefill batch (the paper's setting); a number: pack prompts (and
    # size Sarathi chunks) up to this many tokens per prefill batch.
    prefill_token_budget: int | None = None
    # decode batches of a multi-stage model in flight at once: "stages" (S; the default), "Nx"
    # (N x S), a number, or "unbounded" (the paper's rule). engine/policies/inflight_bound.py
    decode_batches_in_flight: str | int = "stages"

    def engine_options(self, on_cpu: bool) -> dict:
        """EngineScheduler keyword arguments (minus the policy's engine id), the same for a
        served engine (engine_builder) and a simulated one (simulator/cluster.py).

        A `prefill_token_budget` packs waiting prompts (up to `max_batch_size` of them) into
        one prefill batch under that many tokens, as the config promises. Without one, a GPU
        engine keeps the paper's one prompt per prefill batch, while a CPU engine packs under
        the scheduler's default budget: a CPU matmul over all prompts' rows at once runs ~1.4x
        more FLOP/s than one prompt at a time (M=4096 vs M=128 rows for SmolLM2's shapes), and
        the engine's one forward pass per batch is the unit of work on a CPU."""
        opts: dict = {"max_batch_size": self.max_batch_size, "policy": self.policy,
                      "decode_batches_in_flight": self.decode_batches_in_flight}
        if self.prefill_token_budget is not None:
            opts["prefill_token_budget"] = self.prefill_token_budget
        if self.prefill_token_budget is not None or on_cpu:
            opts["prefill_max_requests"] = self.max_batch_size
        return opts


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
        out["models"] = [_model_to_dict(m, with_rate=not zipf) for m in self.models]
        out["planner"] = _asdict(self.planner)
        out["scheduler"] = _asdict(self.scheduler, drop_none=True)
        if self.workload is not None:
            out["workload"] = _asdict(self.workload, drop_none=True)
        return out


def _asdict(obj, drop_none: bool = False) -> dict:
    d = {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    return {k: v for k, v in d.items() if not (drop_none and v is None)}


def _model_to_dict(m: ModelConfig, with_rate: bool) -> dict:
    d: dict = {"name": m.name}
    if m.source_kind == "builtin" and m.source and catalog.get_arch(m.source) == m.arch:
        d["arch"] = m.source
    else:
        d["arch"] = m.arch.to_dict()  # resolved numbers: no need to re-read the header
        if m.source:
            d["source"] = m.source
            d["source_kind"] = m.source_kind
    if with_rate:
        d["rate"] = m.rate
    for key in ("slo_ttft_ms", "slo_tbt_ms"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    return d


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
def load_config(path: str) -> Config:
    """Read a YAML (.yaml/.yml) or JSON (.json) config file and validate it."""
    return _parse_config(read_config_file(path), path, os.path.dirname(os.path.abspath(path)))


def _parse_config(data, source: str, base_dir: str) -> Config:
    if data is None:
        raise ConfigError("", f"{source} is empty; it needs at least `cluster:` and `models:`")
    top = Section(data, "", ("name", "cluster", "models", "planner", "scheduler", "workload"))
    if not top.has("cluster"):
        raise ConfigError("cluster", "missing required section (num_engines, device, tp, memory_gb, ...)")
    cluster = _parse_cluster(data["cluster"], base_dir)
    models_raw = data.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("models", "expected a non-empty list of model entries")
    models = [_parse_model(m, f"models[{i}]", base_dir) for i, m in enumerate(models_raw)]
    _check_models(models, cluster)
    planner = _parse_planner(data.get("planner") or {})
    scheduler = _parse_scheduler(data.get("scheduler") or {})
    workload = _parse_workload(data["workload"], base_dir) if top.has("workload") else None
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


def _parse_cluster(raw, base_dir: str) -> ClusterConfig:
    from paraflex.devices import get_device

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
        profile_dir = resolve_path(profile_dir, base_dir)
        if not os.path.isdir(profile_dir):
            raise ConfigError("cluster.profile_dir", f"{profile_dir} is not a directory")
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


_MODEL_KEYS = ("name", "arch", "hf", "gguf", "rate", "slo_ttft_ms", "slo_tbt_ms", "dtype",
               "source", "source_kind")


def _parse_model(raw, path: str, base_dir: str) -> ModelConfig:
    s = Section(raw, path, _MODEL_KEYS)
    given = [k for k in ("arch", "hf", "gguf") if s.has(k)]
    if len(given) != 1:
        raise ConfigError(
            path,
            "give exactly one of `arch: <built-in name>`, `hf: <model dir>`, `gguf: <file>`"
            + (f" (found {', '.join(given)})" if given else ""),
        )
    kind = given[0]
    try:
        arch, source, source_kind = _resolve_arch(s, kind, base_dir)
    except UserError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(s.at(kind), str(exc)) from None
    dtype = s.str("dtype", choices=tuple(_DTYPES))
    if dtype is not None:
        arch = arch.with_dtype_bytes(_DTYPES[dtype])
    name = s.str("name", default=arch.name)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*", name):
        raise ConfigError(s.at("name"), f"{name!r}: use letters, digits, '.', '_' and '-' only")
    return ModelConfig(
        name=name,
        arch=arch,
        rate=s.num("rate", 1.0, positive=True),
        slo_ttft_ms=s.num("slo_ttft_ms", positive=True),
        slo_tbt_ms=s.num("slo_tbt_ms", positive=True),
        source=source,
        source_kind=source_kind,
    )


def _resolve_arch(s: Section, kind: str, base_dir: str):
    value = s.data[kind]
    if kind == "arch" and isinstance(value, dict):  # resolved numbers (from to_dict)
        arch = _arch_from_mapping(value, s.at("arch"))
        source = s.str("source")
        return arch, source, s.str("source_kind", "builtin", choices=("builtin", "hf", "gguf"))
    if s.has("source") or s.has("source_kind"):
        raise ConfigError(s.at("source"), "only allowed with an `arch:` mapping; use arch/hf/gguf")
    text = s.str(kind)
    if kind == "arch":
        return catalog.get_arch(text), text.lower(), "builtin"
    if kind == "hf":
        folder = resolve_path(text, base_dir)
        return arch_files.arch_from_hf_config(folder), folder, "hf"
    if text.lower() == "smollm2-135m":
        # The package GGUF's header equals the built-in entry (tests check it); reading the
        # header costs ~5 s of token-list parsing, so the built-in numbers are used here.
        return catalog.get_arch("smollm2-135m"), arch_files.smollm2_gguf_path(), "gguf"
    path = resolve_path(text, base_dir)
    return arch_files.arch_from_gguf(path), path, "gguf"


def _arch_from_mapping(d: dict, path: str) -> ModelArch:
    """An inline `arch:` mapping, each field read with its type: name a string, sizes positive
    integers, rope_theta/rms_norm_eps numbers > 0, flags booleans, rope_scaling a mapping."""
    fields = ModelArch.__dataclass_fields__
    s = Section(d, path, tuple(fields))
    kw = {"name": s.str("name", required=True)}
    for key in _ARCH_INTS:
        default = fields[key].default
        kw[key] = s.int(key, None if default is MISSING else default, required=default is MISSING, minimum=1)
    kw.update({key: s.num(key, fields[key].default, positive=True) for key in _ARCH_FLOATS})
    kw.update({key: s.bool(key, fields[key].default) for key in _ARCH_FLAGS})
    if kw["dtype_bytes"] not in (1, 2, 4):
        raise ConfigError(s.at("dtype_bytes"), f"must be 1, 2 or 4 bytes per parameter (float8, 16-bit, float32), got {kw['dtype_bytes']}")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ConfigError(s.at("rope_scaling"), f"expected a mapping (as in HF config.json) or nothing, got {value_kind(rope_scaling)}")
    return ModelArch(**kw, rope_scaling=rope_scaling)


def _check_models(models: list[ModelConfig], cluster: ClusterConfig) -> None:
    seen: dict[str, int] = {}
    total_mem = cluster.num_engines * cluster.memory_bytes
    for i, m in enumerate(models):
        path = f"models[{i}]"
        if m.name in seen:
            raise ConfigError(f"{path}.name", f"duplicate name {m.name!r} (also models[{seen[m.name]}]); give each instance its own name")
        seen[m.name] = i
        a = m.arch
        for attr in _ARCH_INTS:
            if not isinstance(getattr(a, attr), int) or getattr(a, attr) <= 0:
                raise ConfigError(f"{path}.arch.{attr}", f"must be a positive integer, got {getattr(a, attr)!r}")
        if a.num_heads % a.num_kv_heads:
            raise ConfigError(f"{path}.arch.num_kv_heads", f"{a.num_kv_heads} does not divide num_heads={a.num_heads}")
        for attr in ("num_heads", "num_kv_heads"):
            if getattr(a, attr) % cluster.tp:
                raise ConfigError(
                    f"{path}.arch",
                    f"cluster.tp={cluster.tp} does not divide {attr}={getattr(a, attr)} of {a.name}; "
                    "choose a TP degree that divides the model's attention heads and KV heads",
                )
        if a.weight_bytes() > total_mem:
            raise ConfigError(
                f"{path}.arch",
                f"{a.name} needs {a.weight_bytes() / GIB:.1f} GiB of weights but the whole cluster has "
                f"{total_mem / GIB:.1f} GiB ({cluster.num_engines} engines x {cluster.memory_gb:g} GiB); "
                "add engines, raise cluster.memory_gb or drop the model",
            )


def _parse_planner(raw) -> PlannerConfig:
    s = Section(raw, "planner", tuple(PlannerConfig.__dataclass_fields__))
    return PlannerConfig(
        target_stage_time=_parse_stage_time(s.data.get("target_stage_time", "auto")),
        kappa_gb=s.num("kappa_gb", 0.1, nonneg=True),
        ring=s.bool("ring", False),
        fill_engines=s.bool("fill_engines", True),
    )


def _parse_stage_time(ts) -> str | float:
    """T_s: "auto", "xK" / "/K" (kept as text), or milliseconds (a number, "50", "50ms")."""
    path = "planner.target_stage_time"
    if isinstance(ts, bool) or not isinstance(ts, (str, int, float)):
        raise ConfigError(path, f"expected auto, milliseconds, 'x2' or '/2', got {value_kind(ts)}")
    if isinstance(ts, str):
        ts = ts.strip().lower()
        ms = _MS_RE.match(ts)
        if ms is None:
            factor = _STAGE_TIME_RE.match(ts)
            if ts != "auto" and factor is None:
                raise ConfigError(path, f"{ts!r} is not auto, a number of milliseconds, 'xK' or '/K' (e.g. x2, /2)")
            if factor is not None and float(factor.group(2)) <= 0:
                raise ConfigError(path, f"the factor in {ts!r} must be > 0")
            return ts
        ts = ms.group(1)
    ts = float(ts)
    if not math.isfinite(ts) or ts <= 0:
        raise ConfigError(path, f"must be > 0 ms, got {ts:g}")
    return ts


def _parse_scheduler(raw) -> SchedulerConfig:
    s = Section(raw, "scheduler", tuple(SchedulerConfig.__dataclass_fields__))
    block = s.int("block_bytes", 32768, minimum=1)
    if block & (block - 1):
        raise ConfigError("scheduler.block_bytes", f"{block} is not a power of two (e.g. 32768)")
    return SchedulerConfig(
        max_batch_size=s.int("max_batch_size", 32, minimum=1),
        block_bytes=block,
        policy=s.str("policy", "full-batch-first", choices=POLICIES),
        prefill_token_budget=s.int("prefill_token_budget", None, minimum=1),
        decode_batches_in_flight=_inflight(s),
    )


def _inflight(s: Section) -> str | int:
    from paraflex.engine.policies.inflight_bound import config_value, parse_inflight_limit

    raw = s.data.get("decode_batches_in_flight", "stages")
    return config_value(parse_inflight_limit(raw))
