"""Live placement changes on the Ray backend: a two-stage replica of tiny-8l is added on other
engines (its process group built) and the old one removed (its group dropped) while streams run
at it, then the change is undone the same way; every request ends with all its tokens, and the
hops after each change go through the new replica's group only (a stale group would hang them)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import ray

from hand_placement import hand_placement
from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.ray_startup import start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a stuck stage change fails, not hangs CI

NUM_ENGINES, KV = 4, 4 << 20
OLD = {"tiny-2l": (2, [(0, 2)], [[2], [3]]), "tiny-8l": (8, [(0, 4), (4, 8)], [[0, 1]])}
NEW = {"tiny-2l": (2, [(0, 2)], [[2], [3]]), "tiny-8l": (8, [(0, 4), (4, 8)], [[2, 3]])}
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _config() -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": NUM_ENGINES, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0.05},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}, {"name": "tiny-8l", "arch": "tiny-8l"}],
        "scheduler": {"max_batch_size": 8},
    }, source="ray-live-test")


@pytest.fixture(scope="module")
def backend(ray_session):
    b = start_cluster(_config(), hand_placement(OLD, NUM_ENGINES, KV), progress=lambda line: None)
    b.changer.drain_timeout_s = 0.5  # then what still runs on the removed replica moves by recompute
    yield b
    b.shutdown()


async def _one(b, rid):
    tokens, last = [], None
    async for out in b.stream("tiny-8l", [256, 5, len(rid)], PARAMS, rid):
        tokens += out.token_ids
        last = out
    return rid, len(tokens), last.finish_reason, last.error


def _change_while_streaming(b, layout) -> tuple[dict, list]:
    report = {}

    async def go():
        change = threading.Thread(target=lambda: report.update(b.change_placement(hand_placement(layout, NUM_ENGINES, KV))))
        jobs = [asyncio.create_task(_one(b, f"{id(layout)}-a{i}")) for i in range(6)]
        await asyncio.sleep(0.3)
        change.start()
        i = 0
        while change.is_alive() or i < 4:  # streams start while the change is under way, and after
            jobs.append(asyncio.create_task(_one(b, f"{id(layout)}-b{i}")))
            i += 1
            await asyncio.sleep(0.1)
        return await asyncio.gather(*jobs)

    results = asyncio.run(go())
    return report, results


def _groups(b) -> dict[int, dict]:
    return {e: ray.get(a.status.remote(), timeout=10)["groups"] for e, a in b.engines.actors.items()}


def test_a_replica_added_and_removed_on_ray_while_streams_run_loses_nothing(backend):
    assert _groups(backend)[0] == {"tiny-8l/0": 0}
    report, results = _change_while_streaming(backend, NEW)
    assert [(a["op"], a["engines"]) for a in report["actions"]] == [("add", [2, 3]), ("remove", [0, 1])]
    assert all(r[1:] == (PARAMS.max_tokens, "length", None) for r in results), results
    assert backend.placement().to_dict() == hand_placement(NEW, NUM_ENGINES, KV).to_dict()
    groups = _groups(backend)
    assert groups[0] == {} and groups[1] == {} and groups[2] == {"tiny-8l/1": 0} == groups[3]
    # back to engines 0 and 1: a new group there (a stale one would take the hops and hang them)
    report, results = _change_while_streaming(backend, OLD)
    assert [(a["op"], a["engines"]) for a in report["actions"]] == [("add", [0, 1]), ("remove", [2, 3])]
    assert all(r[1:] == (PARAMS.max_tokens, "length", None) for r in results), results
    assert _groups(backend)[0] == {"tiny-8l/2": 0}
    metrics = backend.metrics()
    assert metrics.placement_actions == {("add", "done"): 2, ("remove", "done"): 2}
    assert metrics.placement_moved_bytes == sum(a["weight_bytes"] for a in report["actions"] if a["op"] == "add") * 2
