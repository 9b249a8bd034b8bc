"""Prism's global model placement (Prism §6.2, Alg. 1): balance KV pressure across GPUs.

KVPR_g = sum over models on g of r_j / s_j (SLO-weighted request rate) / shared_kv_g (memory
left for KV on g). Models sorted by r/s descending go one by one to the GPU of lowest KVPR;
a model already placed (`current`) moves only if its GPU's KVPR exceeds the best by more than
tau (hysteresis against migrations of marginal benefit). Our addition for more models than
memory: a GPU whose shared KV would fall below `min_kv_bytes` after taking the model is not a
candidate, and a model that fits nowhere is left unplaced (None: it starts evicted and is
activated on demand).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlacedModel:
    name: str
    rate: float  # requests/s
    slo_s: float  # TTFT SLO
    weight_bytes: int


def kvpr(w_rate: float, shared_kv: float) -> float:
    return w_rate / shared_kv if shared_kv > 0 else float("inf")


def kvpr_placement(models: list[PlacedModel], num_gpus: int, capacity: int, tau: float = 0.0,
                   current: dict[str, int] | None = None, min_kv_bytes: int = 0) -> dict[str, int | None]:
    """Model name -> GPU index (None where it fits nowhere)."""
    current = current or {}
    order = sorted(models, key=lambda m: -m.rate / m.slo_s)  # stable for equal pressure
    w_rate = [0.0] * num_gpus
    shared = [float(capacity)] * num_gpus
    out: dict[str, int | None] = {}
    for m in order:
        fits = [g for g in range(num_gpus) if shared[g] - m.weight_bytes >= min_kv_bytes]
        if not fits:
            out[m.name] = None
            continue
        best = min(fits, key=lambda g: (kvpr(w_rate[g], shared[g]), g))
        g = best
        cur = current.get(m.name)
        if cur is not None and cur in fits and kvpr(w_rate[cur], shared[cur]) - kvpr(w_rate[best], shared[best]) <= tau:
            g = cur
        out[m.name] = g
        w_rate[g] += m.rate / m.slo_s
        shared[g] -= m.weight_bytes
    return out
