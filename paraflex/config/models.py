"""The config's `models:` section: each entry's architecture, name, rate and SLOs.

Place in the data flow: `paraflex.config.schema` parses each entry with `parse_model` into a
`ModelConfig` whose `ModelArch` is resolved here (a built-in name from paraflex.models.catalog,
an HF ``config.json`` or a GGUF header via paraflex.models.arch_files, or an inline `arch:`
mapping as `ModelConfig.to_dict` writes it), then `check_models` checks the list against the
cluster (unique names, heads divisible by TP, weights that fit). The planner, the simulator
and `paraflex serve` read the resolved entries. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass

from paraflex.config.cluster import ClusterConfig
from paraflex.config.fields import GIB, Section, resolve_path, value_kind
from paraflex.errors import ConfigError, UserError
from paraflex.models import arch_files, catalog
from paraflex.models.catalog import ModelArch

_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
# ModelArch fields by type, for an inline `arch:` mapping and the checks of every model.
_ARCH_INTS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "max_context", "dtype_bytes")
_ARCH_FLOATS = ("rope_theta", "rms_norm_eps")
_ARCH_FLAGS = ("tie_embeddings", "qkv_bias", "gated_mlp", "linear_bias", "parallel_block")
_MODEL_KEYS = ("name", "arch", "hf", "gguf", "rate", "slo_ttft_ms", "slo_tbt_ms", "dtype", "stages",
               "source", "source_kind")


@dataclass
class ModelConfig:
    name: str
    arch: ModelArch
    rate: float = 1.0  # relative arrival rate (demand share)
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    source: str | None = None  # built-in name, HF directory or GGUF path (weights at serve time)
    source_kind: str = "builtin"  # "builtin" | "hf" | "gguf"
    stages: int | None = None  # explicit pipeline stage count (None: the planner's time-based cut)
    dtype: str | None = None  # the weights' dtype at serve time as the config asks it (None: the engine's default)

    def to_dict(self, with_rate: bool) -> dict:
        """The entry as the config file writes it (`parse_model` reads it back unchanged)."""
        d: dict = {"name": self.name}
        if self.source_kind == "builtin" and self.source and catalog.get_arch(self.source) == self.arch:
            d["arch"] = self.source
        else:
            d["arch"] = self.arch.to_dict()  # resolved numbers: no need to re-read the header
            if self.source:
                d["source"] = self.source
                d["source_kind"] = self.source_kind
        if with_rate:
            d["rate"] = self.rate
        for key in ("slo_ttft_ms", "slo_tbt_ms", "stages", "dtype"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


def parse_model(raw, path: str, base_dir: str) -> ModelConfig:
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
    stages = s.int("stages", minimum=1)
    if stages is not None and stages > arch.num_layers:
        raise ConfigError(s.at("stages"), f"{stages} stages but {arch.name} has {arch.num_layers} layers; "
                          f"use at most {arch.num_layers} (one layer per stage)")
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
        stages=stages,
        dtype=dtype,
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
    return ModelArch(**kw, rope_scaling=rope_scaling, unsupported=s.str("unsupported"))


def check_models(models: list[ModelConfig], cluster: ClusterConfig) -> None:
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
        if m.stages is not None and m.stages > cluster.num_engines:
            raise ConfigError(f"{path}.stages", f"{m.stages} stages but the cluster has {cluster.num_engines} engines "
                              "(a replica puts each stage on its own engine); lower stages or add engines")
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
