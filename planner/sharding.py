"""Per-model sharding (§4.1): config + cost model -> `Problem` with each model's stage cut.

First step of `paraflex plan`: the cost model gives every model's reference execution time;
T_s is `auto` (the smallest model's time), a number of milliseconds, or a multiple (`x2`) /
sub-multiple (`/2`) of auto. A model gets S = round(time / T_s) stages (half rounds up),
at least 1, at most one per layer and at most
one per engine (a replica's stages need distinct engines; capping is reported as a warning); its L layers are cut floor(L/S) per stage with the
remainder given one at a time from the first stage (`problem.split_layers`). Stage weights are
the real bytes of each range (embedding on the first stage, final norm + LM head on the last).
"""

from __future__ import annotations

import math

from paraflex.errors import ConfigError
from paraflex.planner.problem import ModelSpec, Problem


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
    for m, t in zip(config.models, times):
        s = stage_count(t, target, m.arch.num_layers)
        if s > n:
            warnings.append(
                f"{m.name} would need {s} stages (time {t * 1e3:.3g} ms / T_s {target * 1e3:.3g} ms) but the "
                f"cluster has {n} engines: using {n}; raise planner.target_stage_time to keep stages even"
            )
            s = n
        specs.append(ModelSpec.from_arch(m.name, m.arch.num_layers, s, m.rate, m.arch))
    problem = Problem(
        models=tuple(specs),
        num_engines=n,
        memory_bytes=config.cluster.memory_bytes,
        kappa_bytes=config.planner.kappa_bytes,
        ring=bool(config.planner.ring),
    )
    facts = {
        "target_stage_time_ms": target * 1e3,
        "model_time_ms": {m.name: t * 1e3 for m, t in zip(config.models, times)},
        "warnings": warnings,
    }
    return problem, facts
