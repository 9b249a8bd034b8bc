"""End to end: the official `openai` client against the gateway serving a real in-process
cluster (three tiny models on two engines, tests/helpers/gateway_cluster.py) on 127.0.0.1.

Greedy outputs must equal the in-process runtime's; a client that disconnects mid-stream
must leave every engine's KV pool at its idle level; 64 concurrent streams over 3 models
must all end with their tokens or an explicit error."""

from __future__ import annotations

import functools
import asyncio
import random
import threading

import httpx
import openai
import pytest

import polling
from gateway_cluster import MODELS, make_config, make_placement, stream_concurrently
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.gateway.app import build_app
from paraflex.serving.in_process_backend import InProcessBackend
from paraflex.gateway.server import ServerThread
from paraflex.serving.in_process import LLMCluster


@pytest.fixture(scope="module")
def served():
    backend = InProcessBackend.start(make_config(), make_placement(), progress=None)
    server = ServerThread(build_app(backend, max_outstanding=128)).start()
    yield server.url, backend
    server.stop()
    asyncio.run(backend.close())
    assert not [t for t in threading.enumerate() if t.name in ("paraflex-runtime", "paraflex-gateway")]


@pytest.fixture(scope="module")
def reference():
    """A second, independent in-process cluster: what the gateway must reproduce."""
    cluster = LLMCluster(make_config(), make_placement())
    yield cluster
    cluster.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def pool_usage(backend) -> list[int]:
    return [e.scheduler.pool.num_used for e in backend.cluster.engines]


wait_for = functools.partial(polling.wait_for, timeout=10.0)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_completion_equals_the_runtime(served, reference, model):
    url, _ = served
    prompt = f"The {model} pipeline says"
    want = reference.generate(model, [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    c = client(url)
    got = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids) == 12
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    streamed = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == want.text


def test_greedy_chat_equals_the_runtime_on_the_templated_prompt(served, reference):
    url, _ = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why rings?"}]
    tok = reference.tokenizer("tiny-8l")
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    want = reference.generate("tiny-8l", [ids], SamplingParams(max_tokens=10, temperature=0))[0]
    c = client(url)
    got = c.chat.completions.create(model="tiny-8l", messages=msgs, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ids)
    stream = list(c.chat.completions.create(model="tiny-8l", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want.text
    assert stream[-1].usage.completion_tokens == len(want.token_ids)


def test_seeded_sampling_is_reproducible_through_the_api(served):
    url, _ = served
    c = client(url)
    kw = dict(model="tiny-2l", prompt="seed me", max_tokens=10, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def test_disconnect_mid_stream_returns_kv_to_idle(served):
    url, backend = served
    assert wait_for(lambda: not backend.metrics().running.get("tiny-8l") and sum(pool_usage(backend)) == 0)
    idle = pool_usage(backend)
    body = {"model": "tiny-8l", "prompt": "x" * 200, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        events = r.iter_lines()
        assert next(e for e in events if e.startswith("data: "))
        busy = pool_usage(backend)
        assert sum(busy) > sum(idle)  # the request holds KV on both engines while it streams
        assert all(b > i for b, i in zip(busy, idle))
    assert wait_for(lambda: pool_usage(backend) == idle), f"KV not freed: {pool_usage(backend)} vs idle {idle}"
    assert backend.metrics().running["tiny-8l"] == 0


@pytest.mark.slow
def test_64_concurrent_streams_over_three_models_none_lost(served):
    url, backend = served
    rng = random.Random(7)
    jobs = [(MODELS[i % 3], rng.randint(2, 24)) for i in range(64)]

    results = stream_concurrently(url, jobs, prompt_prefix="req", timeout=180)
    assert len(results) == 64
    for (model, n), (kind, detail, tokens) in zip(jobs, results):
        assert kind in ("ok", "error")
        if kind == "ok":
            assert (detail, tokens) == ("length", n), (model, n, detail, tokens)
        else:
            assert detail  # an explicit error message, never a silent loss
    assert sum(kind == "ok" for kind, _, _ in results) == 64
    assert wait_for(lambda: sum(pool_usage(backend)) == 0), f"KV not freed after all streams ended: {pool_usage(backend)}"


def test_over_context_and_unknown_model_through_the_real_backend(served):
    url, _ = served
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny-2l", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="llama-2-7b", prompt="hi")


def test_metrics_and_health_report_every_model_and_engine(served):
    url, _ = served
    client(url).completions.create(model="tiny-4l", prompt="count me", max_tokens=3,
                                   extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for m in MODELS:
        assert f'vllm:num_requests_running{{model_name="{m}"}}' in text
    assert 'vllm:kv_cache_usage_perc{engine="0"}' in text and 'vllm:kv_cache_usage_perc{engine="1"}' in text
    gen = [line for line in text.splitlines() if line.startswith('vllm:generation_tokens_total{model_name="tiny-4l"}')]
    assert float(gen[0].split()[-1]) >= 3
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["engines"] == {"0": "alive", "1": "alive"}
