"""Human views of a `Placement`: the text table `paraflex plan` prints and a Fig. 4-style PNG.

Last step of `paraflex plan`: engines as rows (table) or columns (PNG) with their resident
stages, weights and planned KV per model, plus the objective Phi*.
"""

from __future__ import annotations

from paraflex.costs.topology import cross_node_hops, nodes_of
from paraflex.placement import Placement

GIB = 2**30


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def table(placement: Placement) -> str:
    """Readable summary: models (stages, replicas), engines (stages, weights, KV), Phi*."""
    p = placement.params
    mem = p.get("engine_memory_bytes", 0)
    lines = [
        f"planner {placement.planner}: {placement.num_engines} engines x {_gib(mem)} GiB"
        + (f" (each {p['devices_per_engine']} devices, TP {p.get('tp')})" if p.get("devices_per_engine", 1) > 1 else "")
        + ", "
        f"kappa {_gib(p.get('kappa_bytes', 0))} GiB, ring {'on' if p.get('ring') else 'off'}"
        + (f", T_s {p['target_stage_time_ms']:.3g} ms" if "target_stage_time_ms" in p else ""),
        "",
        f"{'model':<28}{'rate':>6}{'stages':>7}{'replicas':>9}  layer ranges / replica engines",
    ]
    rates = p.get("rates", {})
    for name, m in placement.models.items():
        ranges = " ".join(f"[{a},{b})" for a, b in m.stages)
        reps = " ".join("-".join(str(e) for e in r) for r in m.replicas)
        lines.append(f"{name:<28}{rates.get(name, 0):>6.2f}{m.num_stages:>7}{m.num_replicas:>9}  {ranges}  on  {reps}")
    lines += ["", f"{'engine':<7}{'weights GiB':>12}{'KV GiB':>8}{'free GiB':>9}  resident stages (model:replica.stage, KV GiB)"]
    for e in placement.engines:
        kv = sum(e.kv_bytes.values())
        cells = ", ".join(f"{r.model}:{r.replica}.{r.stage} ({_gib(e.kv_bytes.get(r.model, 0))})" for r in e.stages)
        lines.append(f"{e.id:<7}{_gib(e.weight_bytes):>12}{_gib(kv):>8}{_gib(mem - e.weight_bytes - kv):>9}  {cells or '(idle)'}")
    lines += ["", "KV per stage by model (DRF):"]
    for name in placement.models:
        grants = [e.kv_bytes[name] for e in placement.engines if name in e.kv_bytes]
        if grants:
            lines.append(f"  {name:<28}{_gib(min(grants)):>8} GiB  ({min(grants) / mem:6.1%} of engine memory)")
    lines.append(
        f"Phi* = {placement.objective:.4f} (smallest per-stage KV share: {_gib(p.get('objective_bytes', 0))} GiB)"
    )
    if p.get("nodes") and len(p["nodes"]) > 1:
        node_of = nodes_of(tuple(p["nodes"]))
        replicas = [r for m in placement.models.values() for r in m.replicas]
        if len(node_of) == placement.num_engines:
            crossing = sum(cross_node_hops(node_of, r) for r in replicas)
            hops = sum(len(r) - 1 for r in replicas)
            lines.append(f"nodes {p['nodes']} (engines per node): {crossing} of {hops} pipeline hops cross nodes")
    if p.get("stop_reason"):
        lines.append(f"replication stopped: {p['stop_reason']}")
    return "\n".join(lines)


def png(placement: Placement, path: str) -> None:
    """Engines as columns; each resident stage a block (solid = weights, light = planned KV)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(placement.models)
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    color = {n: cmap(k % cmap.N) for k, n in enumerate(names)}
    mem = placement.params.get("engine_memory_bytes", 1)
    width = max(6.0, 0.6 * placement.num_engines + 2)
    fig, ax = plt.subplots(figsize=(min(width, 40), 4.5))
    for e in placement.engines:
        y = 0.0
        layers = [_layers(placement, r) for r in e.stages]
        for ref, n_layers in zip(e.stages, layers):
            h = e.weight_bytes * n_layers / max(1, sum(layers)) / GIB  # weights split by layer count
            ax.bar(e.id, h, bottom=y, color=color[ref.model], edgecolor="black", linewidth=0.5)
            if placement.num_engines <= 32:
                ax.text(e.id, y + h / 2, f"s{ref.stage}", ha="center", va="center", fontsize=7)
            y += h
        for ref in e.stages:
            kv = e.kv_bytes.get(ref.model, 0) / GIB
            ax.bar(e.id, kv, bottom=y, color=color[ref.model], alpha=0.35, edgecolor="grey", linewidth=0.3)
            y += kv
    ax.axhline(mem / GIB, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("engine")
    ax.set_ylabel("GiB (solid: weights, light: planned KV)")
    ax.set_title(f"{placement.planner} placement, Phi* = {placement.objective:.3f}")
    ax.set_xticks(range(placement.num_engines) if placement.num_engines <= 64 else [])
    ax.legend(handles=[Patch(color=color[n], label=n) for n in names], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layers(placement: Placement, ref) -> int:
    a, b = placement.stage_layers(ref.model, ref.stage)
    return b - a
