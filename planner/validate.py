"""Check a placement against its config: every constraint of §4.2, one line per violation.

Used by `paraflex plan --validate placement.json CONFIG` and by `api.plan` on every plan it
writes; `require_valid_layout` is the check every entry point that runs a given placement makes
(`LLMCluster`, the Ray backend, `serve`/`generate --placement`). Checks: the file's structure (`Placement.structural_problems`: every layer of every
replica placed exactly once, engines listing exactly the stages the models place there);
models and layer counts match the config; P1 (a replica's stages on consecutive engines in
ascending order, wrapping only when the plan was made with `ring`); (4) no two stages of one
model on one engine; weight bytes as recomputed from the architecture; (5) memory: weights +
planned KV within the engine's memory; (6) every resident stage planned at least kappa of KV;
the recorded objective (Phi* as a share of engine memory, and `params.objective_bytes`) equal to
the one recomputed from the stages' weights (a file edited by hand, or by another tool, cannot
claim a better plan than it is).
"""

from __future__ import annotations

import math

from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.planner.drf import min_level

_OBJECTIVE_RTOL = 1e-6


def violations(placement: Placement, config) -> list[str]:
    """Every violation: the layout's (`layout_violations`), then the planning figures'."""
    return layout_violations(placement, config) + _budget_violations(placement, config)


def require_valid_layout(placement: Placement, config, source: str = "placement",
                         required: list[str] | None = None) -> list[str]:
    """Raise a UserError naming the first layout violations that would run wrongly (what every
    entry point that runs a placement checks: `LLMCluster`, the Ray backend, serve and generate
    with `--placement`): the structure, the engine count, unknown models, layer counts, (4).
    Returns the P1 violations (stages out of consecutive order: the engines run such a route
    correctly, only slower to reach), for the caller to warn about. The planning figures
    (recorded weights, KV shares, kappa, the objective) are left to `paraflex plan --validate`:
    the engines measure their own weights and size their own KV pools. `required`: the models
    that must be placed (default: all of the config's)."""
    problems = layout_violations(placement, config, required)
    fatal = [p for p in problems if not p.startswith("P1:")]
    if fatal:
        more = f" (and {len(fatal) - 3} more)" if len(fatal) > 3 else ""
        raise UserError(f"{source}: invalid placement for {config.source}: " + "; ".join(fatal[:3]) + more
                        + f"; fix it or re-plan with `paraflex plan {config.source} -o placement.json` "
                          "(`paraflex plan --validate` lists every violation)")
    return [p for p in problems if p.startswith("P1:")]


def layout_violations(placement: Placement, config, required: list[str] | None = None) -> list[str]:
    """The layout's violations: the structure, engine count, models and layer counts, P1 and (4).
    `required`: the models that must be placed (default: all of the config's)."""
    out = list(placement.structural_problems())
    per_engine = max(1, int(placement.params.get("devices_per_engine", 1)))
    n_cfg = config.cluster.num_engines
    if placement.num_engines * per_engine != n_cfg:
        out.append(
            f"placement has {placement.num_engines} engines x {per_engine} devices but the config has "
            f"cluster.num_engines = {n_cfg}"
        )
    ring = bool(placement.params.get("ring", False))
    archs = {m.name: m.arch for m in config.models}
    for name in archs if required is None else required:
        if name not in placement.models:
            out.append(f"model {name} (in the config) is not placed")
    n = placement.num_engines
    for name, m in placement.models.items():
        arch = archs.get(name)
        if arch is None:
            out.append(f"model {name} is not in the config")
            continue
        if m.num_layers != arch.num_layers:
            out.append(f"model {name}: placement says {m.num_layers} layers, the config's architecture has {arch.num_layers}")
            continue
        for j, rep in enumerate(m.replicas):
            if any(not 0 <= e < n for e in rep) or len(rep) != len(m.stages):
                continue  # already reported as structural
            for k in range(1, len(rep)):
                step = (rep[k] - rep[k - 1]) % n if ring else rep[k] - rep[k - 1]
                if step != 1:
                    out.append(
                        f"P1: model {name} replica {j}: stage {k} on engine {rep[k]} does not follow stage {k - 1} "
                        f"on engine {rep[k - 1]} (stages must run on consecutive ascending engines)"
                    )
                    break
        seen: dict[int, tuple[int, int]] = {}
        for j, rep in enumerate(m.replicas):
            for k, e in enumerate(rep):
                if e in seen:
                    out.append(
                        f"(4): model {name} has two stages on engine {e} (replica {seen[e][0]} stage {seen[e][1]} "
                        f"and replica {j} stage {k})"
                    )
                seen[e] = (j, k)
    return out


def _budget_violations(placement: Placement, config) -> list[str]:
    """The planning figures: recorded weights, (5) memory, KV per resident model, (6) kappa and
    the recorded objective."""
    out: list[str] = []
    memory = config.cluster.memory_bytes * max(1, int(placement.params.get("devices_per_engine", 1)))
    kappa = config.planner.kappa_bytes
    weights = _stage_weights(placement, config)
    n = placement.num_engines
    for eng in placement.engines:
        if not 0 <= eng.id < n:
            continue
        if eng.weight_bytes != weights[eng.id]:
            out.append(
                f"engine {eng.id}: records {_gib(eng.weight_bytes)} of weights, its stages weigh {_gib(weights[eng.id])}"
            )
        used = weights[eng.id] + sum(eng.kv_bytes.values())
        if used > memory:
            out.append(
                f"(5): engine {eng.id}: weights {_gib(weights[eng.id])} + planned KV {_gib(sum(eng.kv_bytes.values()))} "
                f"exceed its memory {_gib(memory)}"
            )
        for model in sorted({r.model for r in eng.stages}):
            kv = eng.kv_bytes.get(model)
            if kv is None:
                out.append(f"engine {eng.id}: no KV planned for resident model {model}")
            elif kv < kappa:
                out.append(f"(6): engine {eng.id}: model {model} gets {_gib(kv)} of KV, below kappa {_gib(kappa)}")
        for model in eng.kv_bytes:
            if model in placement.models and model not in {r.model for r in eng.stages}:
                out.append(f"engine {eng.id}: plans KV for {model}, which has no stage there")
    out += _objective_problems(placement, weights, memory)
    return out


def _stage_weights(placement: Placement, config) -> list[int]:
    """Per engine, the weight bytes of its stages as the config's architectures give them."""
    archs = {m.name: m.arch for m in config.models}
    n = placement.num_engines
    weights = [0] * n
    for name, m in placement.models.items():
        arch = archs.get(name)
        if arch is None or m.num_layers != arch.num_layers:
            continue
        for rep in m.replicas:
            if any(not 0 <= e < n for e in rep) or len(rep) != len(m.stages):
                continue
            last = len(rep) - 1
            for k, e in enumerate(rep):
                a, b = m.stages[k]
                if 0 <= a <= b <= arch.num_layers:
                    weights[e] += arch.stage_weight_bytes(a, b, k == 0, k == last)
    return weights


def _objective_problems(placement: Placement, weights: list[int], memory: int) -> list[str]:
    """The recorded Phi* against the one the stages' weights give (DRF's first water level)."""
    counts = [0] * placement.num_engines
    for eng in placement.engines:
        if 0 <= eng.id < placement.num_engines:
            counts[eng.id] = len(eng.stages)
    phi = min_level([memory - w for w in weights], counts)
    if not math.isfinite(phi):
        return []
    out = []
    share = phi / memory
    if not math.isclose(placement.objective, share, rel_tol=_OBJECTIVE_RTOL, abs_tol=1e-12):
        out.append(f"objective: the file records Phi* = {placement.objective:.6g} of engine memory, the placement gives "
                   f"{share:.6g} ({_gib(phi)} per stage)")
    recorded = placement.params.get("objective_bytes")
    if recorded is not None and not math.isclose(float(recorded), phi, rel_tol=_OBJECTIVE_RTOL, abs_tol=1.0):
        out.append(f"objective: params.objective_bytes records {_gib(float(recorded))}, the placement gives {_gib(phi)}")
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"
