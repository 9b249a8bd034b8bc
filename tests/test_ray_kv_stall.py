"""The Ray backend's KV-stall watch: six requests whose decodes outgrow one engine actor's
48-block pool (no swap space) would wait for ever; the monitor hands the engines' batch counts
and the live streams to the watch (paraflex/kv_stall.py), which names the newest request with
tokens; the backend stops it, frees it on the engine and restarts it by recompute
(paraflex/recompute.py) once another request has ended. Every request completes with all its
tokens."""

from __future__ import annotations

import asyncio

import pytest

from hand_placement import hand_placement
from paraflex.config import Config
from paraflex.engine.sampling import SamplingParams
from paraflex.kv_stall import StallWatch

pytestmark = pytest.mark.slow


def _drain(backend, rid: str, prompt: list[int]):
    async def run():
        tokens, last = 0, None
        async for out in backend.stream("tiny-2l", prompt, SamplingParams(max_tokens=120, ignore_eos=True), rid):
            tokens += len(out.token_ids)
            last = out
        return tokens, last.finish_reason, last.error
    return run()


def test_a_kv_stall_restarts_the_newest_holder_by_recompute_and_every_request_completes(ray_session):
    from paraflex.serving import start_cluster

    config = Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l", "rate": 1}],
        "scheduler": {"max_batch_size": 4, "block_bytes": 4096},
    }, source="kv-stall")
    placement = hand_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 1, 200_000)
    backend = start_cluster(config, placement, progress=lambda line: None)
    backend.stall_watch = StallWatch(after_s=1.0)
    try:
        async def all_of_them():
            return await asyncio.gather(*[_drain(backend, f"r{i}", [256] + [5 + i] * 60) for i in range(6)])
        ends = asyncio.run(asyncio.wait_for(all_of_them(), timeout=180))
    finally:
        asyncio.run(backend.close())
    assert ends == [(120, "length", None)] * 6
    assert backend.preemptions["tiny-2l"] >= 1
