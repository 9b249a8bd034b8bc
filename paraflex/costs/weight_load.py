"""How long loading a stage's weights onto an engine takes (live re-planning, issue 22).

Place in the data flow: the incremental planner (planner/incremental.py) prices each add action
with `stage_load_time`, and the simulator (simulator/core/live_placement.py) charges the same
time before an added replica serves. Weights stream from host memory over each GPU's host link
(PCIe), every GPU of a TP group loading its 1/tp shard in parallel, plus a fixed set-up cost
per operation (allocating, registering the stage with the engine's scheduler).

Check against CoCoServe's Table 2 (4x A100-40GB PCIe, Llama-2-13B, one replication of 1..40
layers: 0.30 s for 1 layer / 1.1 GB to 0.89 s for 40 layers / 24.8 GB): the fixed cost is its
1-layer row less that layer's transfer; with PCIe 4.0 x16 (256 Gbit/s) the model gives 0.30 s
for 1 layer and 1.08 s for 40 layers, 1.0-1.8x CoCoServe's times (its middle rows move 12.4 GiB
in 0.38 s, faster than a host link: they copy from a GPU replica, not from host memory), so
this cost is the conservative one (tests/paraflex/costs/test_weight_load.py pins the check).
"""

from __future__ import annotations

HOST_LINK_GBPS = 256.0  # per GPU: PCIe 4.0 x16
LOAD_OVERHEAD_S = 0.263  # per stage load: CoCoServe Table 2's 1-layer row (0.2987 s) less its 1.1 GB transfer


def stage_load_time(weight_bytes: int, tp: int = 1, host_link_gbps: float = HOST_LINK_GBPS,
                    overhead_s: float = LOAD_OVERHEAD_S) -> float:
    """Seconds to load `weight_bytes` of one stage onto an engine of `tp` GPUs."""
    if weight_bytes <= 0:
        return 0.0
    return overhead_s + weight_bytes / tp / (host_link_gbps * 1e9 / 8)
