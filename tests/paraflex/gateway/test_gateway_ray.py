"""The gateway over the Ray backend (engines as Ray actors, two-phase hops), through HTTP with
the official `openai` client: greedy text equals the in-process runtime, a disconnect
mid-stream returns every engine's KV to idle (seen in /metrics), 64 concurrent streams over
three models all end with their tokens or an explicit error, and a killed engine shows in
/health while the models it does not host keep serving."""

from __future__ import annotations

import functools
import asyncio
import random
import re

import httpx
import openai
import pytest

import polling
from gateway_cluster import MODELS, make_config, make_placement, stream_concurrently
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.gateway.app import build_app
from paraflex.gateway.server import ServerThread
from paraflex.serving.in_process import LLMCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(ray_session):
    from paraflex.serving.ray_startup import start_cluster

    backend = start_cluster(make_config(), make_placement(), progress=lambda line: None)
    server = ServerThread(build_app(backend, max_outstanding=128)).start()
    yield server.url, backend
    server.stop()
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def reference():
    cluster = LLMCluster(make_config(), make_placement())
    yield cluster
    cluster.shutdown()


def kv_usage(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {e: float(v) for e, v in re.findall(r'^vllm:kv_cache_usage_perc\{engine="(\d+)"\} (\S+)$', text, re.M)}


wait_for = functools.partial(polling.wait_for, timeout=15.0, interval=0.1)


def test_greedy_text_equals_the_in_process_runtime(served, reference):
    url, _ = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    for model in MODELS:
        prompt = f"ring of {model}"
        want = reference.generate(model, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        got = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text and got.usage.completion_tokens == 10
        streamed = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in streamed) == want.text


def test_disconnect_mid_stream_returns_kv_to_idle_on_every_engine(served):
    url, _ = served
    assert wait_for(lambda: kv_usage(url) and all(v == 0 for v in kv_usage(url).values()))
    body = {"model": "tiny-8l", "prompt": "y" * 200, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = r.iter_lines()
        for _ in range(3):
            assert next(e for e in events if e.startswith("data: "))
        engines = {str(e) for e in make_placement().models["tiny-8l"].replicas[0]}
        assert wait_for(lambda: all(kv_usage(url)[e] > 0 for e in engines))
    assert wait_for(lambda: all(v == 0 for v in kv_usage(url).values())), kv_usage(url)


def test_64_concurrent_streams_over_three_models_none_lost(served):
    url, _ = served
    rng = random.Random(11)
    jobs = [(MODELS[i % 3], rng.randint(2, 8)) for i in range(64)]

    results = stream_concurrently(url, jobs, prompt_prefix="job", timeout=240)
    assert len(results) == 64
    for (model, n), (kind, detail, tokens) in zip(jobs, results):
        assert kind == "ok" and (detail, tokens) == ("length", n), (model, n, kind, detail, tokens)


def test_killed_engine_shows_in_health_and_other_models_keep_serving(served):
    """Runs last in this module: engine 0 stays dead (no restarts configured)."""
    import ray

    url, backend = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    ray.kill(backend.engines.actors[0], no_restart=True)  # hosts tiny-2l replica 0, tiny-4l and tiny-8l stages
    assert wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, timeout=10)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["engines"]["0"] != "alive" and health["engines"]["1"] == "alive"
    with pytest.raises(openai.APIError):
        c.completions.create(model="tiny-4l", prompt="dead pipeline", max_tokens=4)
    ok = c.completions.create(model="tiny-2l", prompt="still here", max_tokens=4, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 4  # served by the replica on engine 1
