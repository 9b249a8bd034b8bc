"""The Ray backend's KV-stall watch: six requests whose decodes outgrow one engine actor's
48-block pool (no swap space) would wait for ever; the monitor hands the engines' batch counts
and the live streams to the watch (paraflex/serving/kv_stall.py), which names the newest request with
tokens; the backend stops it, frees it on the engine and restarts it by recompute
(paraflex/serving/recompute.py) once another request has ended. Every request completes with all its
tokens. The same engine also shows that a request that can never fit is refused up front,
and one the engine refuses ends alone."""

from __future__ import annotations

import asyncio

import pytest

from hand_placement import hand_placement
from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.serving.kv_stall import StallWatch

pytestmark = pytest.mark.slow


def _drain(backend, rid: str, prompt: list[int], max_tokens: int = 120):
    async def run():
        tokens, last = 0, None
        async for out in backend.stream("tiny-2l", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid):
            tokens += len(out.token_ids)
            last = out
        return tokens, last.finish_reason, last.error
    return run()


@pytest.fixture(scope="module")
def backend(ray_session):
    """One engine actor with a 48-block pool (384 tokens per layer for tiny-2l) and no swap."""
    from paraflex.serving.ray_startup import start_cluster

    config = Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l", "rate": 1}],
        "scheduler": {"max_batch_size": 4, "block_bytes": 4096},
    }, source="kv-stall")
    placement = hand_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 1, 200_000)
    backend = start_cluster(config, placement, progress=lambda line: None)
    backend.frontend.stall_watch = StallWatch(after_s=1.0)
    yield backend
    asyncio.run(backend.close())


def test_a_request_whose_kv_outgrows_an_engine_pool_is_refused_up_front(backend):
    """Inside the model's context (2,048) but not inside the engine's pool: a 400-style error
    naming max_tokens, before any engine sees it (it used to fail the engine actor for good)."""
    with pytest.raises(UserError, match=r"max_tokens: prompt \(3\) \+ max_tokens \(400\) of tiny-2l need KV for 402 "
                                        r"tokens on engine 0, whose pool holds 384"):
        asyncio.run(_drain(backend, "big", [256, 5, 6], max_tokens=400))
    assert backend.health()["ok"]
    assert backend.models()[0].max_context == 385  # /v1/models' max_model_len: what the pool holds


def test_a_request_the_engine_refuses_ends_with_an_error_and_the_engine_goes_on(backend):
    """An id the engine has seen before (the backend forgets ended streams; the engine does
    not): that request ends with the engine's refusal, the engine keeps serving."""
    assert asyncio.run(_drain(backend, "again", [256, 5], max_tokens=3)) == (3, "length", None)
    tokens, reason, error = asyncio.run(_drain(backend, "again", [256, 5], max_tokens=3))
    assert (tokens, reason) == (0, "abort") and error.startswith("engine 0 refused the request: request id 'again' already used")
    assert backend.health()["ok"]
    assert asyncio.run(_drain(backend, "after", [256, 5], max_tokens=3)) == (3, "length", None)


def test_a_kv_stall_restarts_the_newest_holder_by_recompute_and_every_request_completes(backend):
    async def all_of_them():
        return await asyncio.gather(*[_drain(backend, f"r{i}", [256] + [5 + i] * 60) for i in range(6)])
    ends = asyncio.run(asyncio.wait_for(all_of_them(), timeout=180))
    assert ends == [(120, "length", None)] * 6
    assert backend.frontend.restarts.preemptions["tiny-2l"] >= 1
