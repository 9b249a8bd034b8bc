"""Per-model sharding (§4.1): config + cost model -> `Problem` with each model's stage cut.

First step of `paraflex plan`: the cost model gives every model's reference execution time;
T_s is `auto` (the smallest model's time), a number of milliseconds, or a multiple (`x2`) /
sub-multiple (`/2`) of auto. A model gets S = round(time / T_s) stages (half rounds up),
at least 1, at most one per layer and at most
one per engine (a replica's stages need distinct engines; capping is reported as a warning); its L layers are cut floor(L/S) per stage with the
remainder given one at a time from the first stage (`problem.split_layers`). Stage weights are
the real bytes of each range (embedding on the first stage, final norm + LM head on the last).

A stage must also fit an engine with its minimum KV: weights of the largest stage + kappa <=
engine memory. When the time-based S breaks that (two llama-2-70b at TP 1 with `auto`: T_s is
the model's own time, S = 1, 128 GiB on a 72 GiB engine), S is raised to the smallest count
whose stages fit (a warning says so); if even one stage per engine or per layer does not fit,
the error says what to change (more memory per engine, a higher TP, a lower kappa).

A model with `stages: K` in the config skips all of this: it is cut into K even stages as
given (the loader checked 1 <= K <= min(layers, engines)); only the fit is checked here, and a
K whose largest stage does not fit is an error naming `models[i].stages` and the fewest K that
fits. The placement records such models under `fixed_stages`.
"""

from __future__ import annotations

import math

from paraflex.errors import ConfigError, UserError
from paraflex.planner.problem import ModelSpec, Problem

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as the GiB the config is written in (`memory_gb`, `kappa_gb` are GiB)."""
    return f"{nbytes / GIB:.3g} GiB"


def stage_count(model_time: float, target_stage_time: float, num_layers: int) -> int:
    """S = round(model_time / T_s), clamped to [1, num_layers]."""
    if target_stage_time <= 0:
        raise ValueError("target stage time must be > 0")
    return max(1, min(num_layers, math.floor(model_time / target_stage_time + 0.5)))


def build_problem(config, cost_model=None) -> tuple[Problem, dict]:
    """The planning problem of a `Config` and the sharding facts worth recording in the plan."""
    cm = cost_model if cost_model is not None else config.cluster.cost_model()
    times = [cm.model_time(m.arch) for m in config.models]
    target = config.planner.resolve_target_stage_time(min(times))
    if target <= 0:
        raise ConfigError("planner.target_stage_time", "must resolve to a positive time; use auto, milliseconds > 0, xK or /K")
    n = config.cluster.num_engines
    specs, warnings = [], []
    for i, (m, t) in enumerate(zip(config.models, times)):
        if m.stages is not None:  # the config fixes the cut: the planner only places it
            specs.append(_fixed_stages(m, f"models[{i}].stages", config.cluster.memory_bytes,
                                       config.planner.kappa_bytes, n, t))
            continue
        s = stage_count(t, target, m.arch.num_layers)
        if s > n:
            warnings.append(
                f"{m.name} would need {s} stages (time {t * 1e3:.3g} ms / T_s {target * 1e3:.3g} ms) but the "
                f"cluster has {n} engines: using {n}; raise planner.target_stage_time to keep stages even"
            )
            s = n
        spec = ModelSpec.from_arch(m.name, m.arch.num_layers, s, m.rate, m.arch, t)
        fitted = _fit_stages(spec, config.cluster.memory_bytes, config.planner.kappa_bytes, n)
        if fitted.num_stages != s:
            warnings.append(
                f"{m.name}: T_s {target * 1e3:.3g} ms gives {s} stage(s), but its largest stage "
                f"({gib(max(spec.stage_weights))} of weights) plus kappa ({gib(config.planner.kappa_bytes)}) exceeds an "
                f"engine's {gib(config.cluster.memory_bytes)}: using {fitted.num_stages} stages of at most "
                f"{gib(max(fitted.stage_weights))} (a lower planner.target_stage_time cuts every model finer)"
            )
        specs.append(fitted)
    problem = Problem(
        models=tuple(specs),
        num_engines=n,
        memory_bytes=config.cluster.memory_bytes,
        kappa_bytes=config.planner.kappa_bytes,
        ring=bool(config.planner.ring),
        node_of=config.cluster.topology().node_of if config.cluster.nodes else None,
        work_shares=config.planner.replica_shares == "work",
        balance_compute=config.planner.balance_compute,
    )
    facts = {  # (specs hold the final stage counts)
        "target_stage_time_ms": target * 1e3,
        "model_time_ms": {m.name: t * 1e3 for m, t in zip(config.models, times)},
        "warnings": warnings,
        "fixed_stages": {m.name: m.stages for m in config.models if m.stages is not None},
    }
    return problem, facts


def _fixed_stages(model, path: str, memory: int, kappa: int, num_engines: int, model_time: float) -> ModelSpec:
    """The model's spec cut into its configured `stages: K` even stages; ConfigError naming
    `path` when its largest stage plus kappa does not fit an engine (with the fewest K that does)."""
    spec = ModelSpec.from_arch(model.name, model.arch.num_layers, model.stages, model.rate, model.arch, model_time)
    if max(spec.stage_weights) + kappa <= memory:
        return spec
    try:
        fits = f"use stages: {_fit_stages(spec, memory, kappa, num_engines).num_stages} or more"
    except UserError:
        fits = "no stage count fits; give engines more memory (cluster.memory_gb, a higher cluster.tp)"
    raise ConfigError(
        path,
        f"{model.stages} stage(s) of {model.name}: the largest holds {gib(max(spec.stage_weights))} of weights, which "
        f"with kappa = {gib(kappa)} of KV exceeds an engine's {gib(memory)}; {fits}, or lower planner.kappa_gb")


def _fit_stages(spec: ModelSpec, memory: int, kappa: int, num_engines: int) -> ModelSpec:
    """`spec`, or the same model cut into the fewest more stages whose largest stage's
    weights plus kappa fit one engine; UserError when no count up to min(L, N_e) does."""
    limit = min(spec.num_layers, num_engines)
    s = spec.num_stages
    while max(spec.stage_weights) + kappa > memory:
        if s >= limit:
            what = "layer" if limit == spec.num_layers else "engine"
            raise UserError(
                f"{spec.name} does not fit the cluster: cut into {s} stages (one per {what}, the most possible) its "
                f"largest stage holds {gib(max(spec.stage_weights))} of weights, which with kappa = {gib(kappa)} of KV "
                f"exceeds an engine's {gib(memory)}; give engines more memory (cluster.memory_gb, a higher cluster.tp)"
                + (", add engines" if what == "engine" else "") + " or lower planner.kappa_gb"
            )
        s += 1
        spec = spec.resplit(s)
    return spec
