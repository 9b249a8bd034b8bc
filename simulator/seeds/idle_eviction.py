"""Prism's eviction choice (§6.2): only when a GPU lacks memory, evict models idle longer than a
threshold, those with the larger SLO first (then the longest idle).

Returns the models to evict so that `need` bytes become free, or None when evicting every
eligible model is still not enough (then nothing is evicted).
"""

from __future__ import annotations


def models_to_evict(gpu, need: int, t: float, idle_s: float, slo_s: dict[str, float], weights) -> list[str] | None:
    free = gpu.free_bytes()
    if free >= need:
        return []
    eligible = [m for m in gpu.idle_models(t) if t - gpu.last_used.get(m, 0.0) >= idle_s]
    eligible.sort(key=lambda m: (-slo_s[m], gpu.last_used.get(m, 0.0), m))
    out = []
    for m in eligible:
        out.append(m)
        free += weights(m)
        if free >= need:
            return out
    return None
