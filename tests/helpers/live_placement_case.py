"""The live placement change the serving and gateway tests apply: two tiny demo models on three
CPU engines; tiny-2l's replica on engine 2 goes and one on engine 1 comes while streams run."""

from __future__ import annotations

from hand_placement import hand_placement

from paraflex.config.schema import Config

KV = 4 << 20
# tiny-2l: one stage, replicas on engine 0 and engine 2; tiny-4l: two stages on engines 1 -> 2
OLD = {"tiny-2l": (2, [(0, 2)], [[0], [2]]), "tiny-4l": (4, [(0, 2), (2, 4)], [[1, 2]])}
# the change: tiny-2l's replica on engine 2 goes, one on engine 1 comes
NEW = {"tiny-2l": (2, [(0, 2)], [[0], [1]]), "tiny-4l": (4, [(0, 2), (2, 4)], [[1, 2]])}


def live_config(num_engines: int = 3) -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1, "host_memory_gb": 0.05},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}, {"name": "tiny-4l", "arch": "tiny-4l"}],
        "scheduler": {"block_bytes": 4096, "max_batch_size": 4},
    }, source="live-test")


def placement(layout: dict, num_engines: int = 3, kv_bytes: int = KV):
    return hand_placement(layout, num_engines, kv_bytes)
