"""Build a hand-made `Placement` from a small layout table, for tests that need a fixed
pipeline shape (which engine runs which stage) rather than whatever the planner picks."""

from __future__ import annotations

from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef


def hand_placement(layout: dict, num_engines: int, kv_bytes: int) -> Placement:
    """layout[model] = (num_layers, stage layer ranges, replicas as engine-id lists)."""
    engines = [EnginePlacement(i) for i in range(num_engines)]
    models = {}
    for name, (layers, cuts, replicas) in layout.items():
        models[name] = ModelPlacement(name, layers, list(cuts), [list(r) for r in replicas])
        for j, route in enumerate(replicas):
            for k, eid in enumerate(route):
                engines[eid].stages.append(StageRef(name, j, k))
                engines[eid].kv_bytes[name] = kv_bytes
    return Placement(1, "hand", {}, 0.0, models, engines)
