"""One GPU (or TP group) of an Aegaeon pool: the model it runs, the one it prefetches, its host link.

`switch_to` makes `model` the running model (Eq. 4's cost, or what is left of a prefetch) and
records the wait as a switch latency; `prefetch` loads the next model on a side stream when both
models' weights and the KV in use fit in memory (SOSP'25 §5.2). Weights and KV transfers share
the host->GPU link (`link_free`).
"""

from __future__ import annotations


class Instance:
    def __init__(self, engine_id: int, role: str, memory: int):
        self.id = engine_id
        self.role = role  # "prefill" | "decode"
        self.memory = memory
        self.active: str | None = None
        self.prefetch_model: str | None = None
        self.prefetch_ready = 0.0
        self.link_free = 0.0
        self.busy = False
        # decode instances: the turn being run, the batch whose KV is on the GPU
        self.turn_batch = None
        self.kv_batch = None
        self.on_gpu: dict[int, float] = {}  # request id -> when its KV is on this GPU
        self.decode_from = 0.0
        self.used = 0.0  # decode time spent in the current turn

    def switch_to(self, model: str, t: float, switch_time, metrics) -> float:
        """Make `model` the running model from t on; return when its weights are ready."""
        if self.active == model:
            return t
        if self.prefetch_model == model:
            ready = max(t, self.prefetch_ready)
        else:
            ready = max(t, self.link_free) + switch_time(model)
            self.link_free = ready
        metrics.switch(ready - t)
        self.active = model
        self.prefetch_model = None
        return ready

    def prefetch(self, model: str | None, t: float, kv_in_use: int, weights, switch_time) -> None:
        if model is None or model == self.active or model == self.prefetch_model:
            return
        if weights(self.active) + weights(model) + kv_in_use > self.memory:
            return
        self.prefetch_model = model
        self.prefetch_ready = self.link_free = max(t, self.link_free) + switch_time(model)

    def room_for_kv(self, model: str, weights) -> int:
        """KV bytes the GPU holds beside `model` (and the model being prefetched)."""
        extra = weights(self.prefetch_model) if self.prefetch_model not in (None, model) else 0
        return self.memory - weights(model) - extra
