"""A small real cluster for the Ray serving tests: the three tiny demo models (random weights,
byte tokenizer) on three CPU engines with a hand-made placement: a three-stage pipeline, a
replicated one-stage model and a two-stage pipeline that wraps around the engine ring."""

from __future__ import annotations

from paraflex.config.schema import Config
from paraflex.placement import Placement

from hand_placement import hand_placement

# model -> (layers, stage layer ranges, replicas as engine per stage)
LAYOUT = {
    "tiny-4l": (4, [(0, 1), (1, 3), (3, 4)], [[0, 1, 2]]),
    "tiny-2l": (2, [(0, 2)], [[1], [2]]),
    "tiny-8l": (8, [(0, 4), (4, 8)], [[2, 0]]),
}
MODELS = list(LAYOUT)
NUM_ENGINES = 3


def make_config() -> Config:
    return Config.from_dict({
        "name": "ray-serving-tests",
        "cluster": {"num_engines": NUM_ENGINES, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0.1},
        "models": [{"name": m, "arch": m, "rate": 1} for m in MODELS],
        "scheduler": {"max_batch_size": 8, "prefill_token_budget": 2048},
    }, source="ray-serving-tests")


def make_placement(kv_bytes: int = 4 << 20) -> Placement:
    return hand_placement(LAYOUT, NUM_ENGINES, kv_bytes)
