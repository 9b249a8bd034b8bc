"""A small real cluster for the gateway's end-to-end tests: the three tiny demo models
(random weights, byte tokenizer) on two CPU engines with a hand-made placement that has
multi-stage pipelines, an unaligned cut and a replicated model."""

from __future__ import annotations

from paraflex.config import Config
from paraflex.placement import Placement

from hand_placement import hand_placement

# model -> (layers, stage layer ranges, replicas as engine per stage)
LAYOUT = {
    "tiny-2l": (2, [(0, 2)], [[0], [1]]),
    "tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]]),
    "tiny-8l": (8, [(0, 4), (4, 8)], [[1, 0]]),
}
MODELS = list(LAYOUT)


def config_dict() -> dict:
    return {
        "name": "gateway-e2e",
        "cluster": {"num_engines": 2, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0.1},
        "models": [{"name": m, "arch": m, "rate": 1} for m in MODELS],
        "scheduler": {"max_batch_size": 8, "prefill_token_budget": 2048},
    }


def make_config() -> Config:
    return Config.from_dict(config_dict(), source="gateway-e2e")


def make_placement(kv_bytes: int = 4 << 20) -> Placement:
    return hand_placement(LAYOUT, 2, kv_bytes)
