"""MuxServe's placement as Aegaeon's evaluation ran it: a fixed set of co-located models per GPU.

The MuxServe paper's greedy places the LLMs in descending order of computation demand
(request rate x parameters) on the mesh of least accumulated demand that still holds them; as
in Aegaeon §7.2, at most 2 models share one GPU (engine) and every model's weights stay resident
(no eviction). More models than that is refused with the shortfall: MuxServe cannot serve them.
"""

from __future__ import annotations

from paraflex.errors import UserError
from paraflex.simulator.seeds.kvpr import PlacedModel

MAX_MODELS_PER_GPU = 2


def muxserve_placement(models: list[PlacedModel], num_gpus: int, capacity: int, min_kv_bytes: dict[str, int],
                       per_gpu: int = MAX_MODELS_PER_GPU) -> dict[str, int]:
    """Model name -> engine. `min_kv_bytes[m]` is KV that must stay free beside m's weights."""
    if len(models) > per_gpu * num_gpus:
        raise UserError(f"muxserve: {len(models)} models on {num_gpus} engines, at most {per_gpu} per engine "
                        f"({per_gpu * num_gpus} models); add engines or drop {len(models) - per_gpu * num_gpus} models")
    demand = [0.0] * num_gpus
    used = [0] * num_gpus
    count = [0] * num_gpus
    out: dict[str, int] = {}
    for m in sorted(models, key=lambda m: -m.rate * m.weight_bytes):
        need = m.weight_bytes + min_kv_bytes.get(m.name, 0)
        fits = [g for g in range(num_gpus) if count[g] < per_gpu and used[g] + need <= capacity]
        if not fits:
            raise UserError(f"muxserve: model {m.name!r} ({m.weight_bytes / 2**30:.1f} GiB of weights) fits on no engine "
                            f"beside the models already placed ({capacity / 2**30:.1f} GiB each, at most {per_gpu} "
                            "models per engine, no eviction); add engines or drop models")
        g = min(fits, key=lambda g: (demand[g], g))
        out[m.name] = g
        demand[g] += m.rate * m.weight_bytes
        used[g] += m.weight_bytes
        count[g] += 1
    return out
