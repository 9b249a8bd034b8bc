"""One GPU (engine) shared by co-located models in MuxServe and Prism: resident weights, one
KV pool taken on demand, the GPU-level request queue, each model's running requests.

KV pages are taken from the GPU's pool only when used and released when freed (Prism's
kvcached, §5.1; MuxServe's unified KV cache): `free_bytes` is memory minus resident weights
minus KV held. A model is `ready` once its activation (Prism) has finished.
"""

from __future__ import annotations


class SharedGPU:
    def __init__(self, engine_id: int, memory: int):
        self.id = engine_id
        self.memory = memory
        self.ready_at: dict[str, float] = {}  # resident model -> when its weights are loaded
        self.weights = 0
        self.kv_used = 0
        self.queue: list = []  # admitted nowhere yet, arrival order
        self.running: dict[str, list] = {}  # model -> admitted requests, admission order
        self.last_used: dict[str, float] = {}
        self.busy = False
        self.turn = -1  # index of the model that ran the last step (round-robin)

    def free_bytes(self) -> int:
        return self.memory - self.weights - self.kv_used

    def load(self, model: str, weight_bytes: int, ready: float) -> None:
        self.ready_at[model] = ready
        self.running.setdefault(model, [])
        self.weights += weight_bytes

    def unload(self, model: str, weight_bytes: int) -> None:
        del self.ready_at[model]
        self.running.pop(model, None)
        self.weights -= weight_bytes

    def is_ready(self, model: str, t: float) -> bool:
        return self.ready_at.get(model, float("inf")) <= t

    def hold(self, r, nbytes: int) -> None:
        r.held += nbytes
        self.kv_used += nbytes

    def release(self, r) -> None:
        self.kv_used -= r.held
        r.held = 0

    def idle_models(self, t: float) -> list[str]:
        """Resident models with no request queued or running here."""
        queued = {r.model for r in self.queue}
        return [m for m in self.ready_at if not self.running.get(m) and m not in queued and self.ready_at[m] <= t]

    def next_model(self, t: float) -> str | None:
        """Round-robin over the ready models with running requests: the time slicing."""
        models = list(self.ready_at)
        for k in range(1, len(models) + 1):
            i = (self.turn + k) % len(models)
            m = models[i]
            if self.running.get(m) and self.ready_at[m] <= t:
                self.turn = i
                return m
        return None
