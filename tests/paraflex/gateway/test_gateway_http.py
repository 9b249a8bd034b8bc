"""The gateway's HTTP contract, through the official `openai` client and raw HTTP, over a
scripted backend (tests/helpers/gateway_fakes.py): response shapes, SSE, usage, stop strings,
OpenAI-style errors, overload, auth, and aborting on disconnect or stop."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import httpx
import openai
import pytest

import polling
from paraflex.gateway.app import SHUTTING_DOWN, build_app
from paraflex.gateway.server import ServerThread
from gateway_fakes import BOS, EchoBackend


@pytest.fixture
def serve():
    """serve(backend, **build_app kwargs) -> base URL; every server stops at teardown."""
    servers = []

    def start(backend, **kwargs) -> str:
        server = ServerThread(build_app(backend, **kwargs)).start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


wait_for = functools.partial(polling.wait_for, timeout=5.0)


def test_models_lists_every_backend_model(serve):
    url = serve(EchoBackend(names=("m1", "m2", "m3"), max_context=99))
    models = client(url).models.list().data
    assert [m.id for m in models] == ["m1", "m2", "m3"]
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 99


def test_completion_non_streaming_and_streaming_agree(serve):
    backend = EchoBackend()
    c = client(serve(backend))
    full = c.completions.create(model="echo-a", prompt="hello", max_tokens=7)
    assert full.choices[0].text == "hellohe"
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (6, 7, 13)
    assert backend.submitted[0][1] == [BOS] + list(b"hello")
    chunks = list(c.completions.create(model="echo-a", prompt="hello", max_tokens=7, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "hellohe"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_accepts_token_id_prompts(serve):
    c = client(serve(EchoBackend()))
    out = c.completions.create(model="echo-a", prompt=[104, 105], max_tokens=3)
    assert out.choices[0].text == "hih" and out.usage.prompt_tokens == 2


def test_chat_non_streaming_and_streaming(serve):
    backend = EchoBackend(max_context=200)
    c = client(serve(backend))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    full = c.chat.completions.create(model="echo-b", messages=msgs, max_tokens=5)
    assert full.choices[0].message.role == "assistant"
    expected_prompt = list(b"<system>S\n<user>hi\n<assistant>")
    assert backend.submitted[0][1] == expected_prompt
    assert full.choices[0].message.content == bytes(expected_prompt[:5]).decode()
    stream = list(c.chat.completions.create(model="echo-b", messages=msgs, max_tokens=5, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_chat_stream_sends_its_role_chunk_with_the_first_token(serve):
    """As vLLM does: a client timing the first token by the first chunk (`vllm bench serve`)
    reads the time to the first token, not the request's arrival."""
    url = serve(EchoBackend(delay=0.4))
    body = {"model": "echo-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        waited = time.monotonic() - start
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert waited >= 0.35  # not sent on arrival: with the first token, 0.4 s in
    assert rest[0]["choices"][0]["delta"]["content"]


def test_chat_without_max_tokens_fills_the_context(serve):
    backend = EchoBackend(max_context=40)
    out = client(serve(backend)).chat.completions.create(model="echo-a", messages=[{"role": "user", "content": "x"}])
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 40


def test_raw_sse_ends_with_done(serve):
    url = serve(EchoBackend())
    with httpx.stream("POST", f"{url}/v1/completions", timeout=10,
                      json={"model": "echo-a", "prompt": "ab", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_string_cuts_the_text_and_frees_the_request(serve):
    backend = EchoBackend(delay=0.01)
    c = client(serve(backend))
    out = c.completions.create(model="echo-a", prompt="abcabcabc", max_tokens=9, stop=["ca"])
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"
    assert wait_for(lambda: not backend.live) and backend.aborted
    chunks = list(c.completions.create(model="echo-a", prompt="abcabcabc", max_tokens=9, stop="bc", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "a"
    assert chunks[-1].choices[0].finish_reason == "stop"


BAD = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 9999]}, "prompt"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 61}, "max_tokens"),  # 4 prompt tokens + 61 > context 64
]


@pytest.mark.parametrize("patch,field", BAD, ids=[f for _, f in BAD])
def test_bad_parameter_is_400_naming_the_field(serve, patch, field):
    url = serve(EchoBackend(max_context=64))
    body = {"model": "echo-a", "prompt": "abc", "max_tokens": 4, **patch}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


def test_openai_client_sees_typed_errors(serve):
    c = client(serve(EchoBackend(max_context=64)))
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="nope", prompt="x")
    assert "nope" in str(nf.value) and "echo-a" in str(nf.value)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.chat.completions.create(model="echo-a", messages=[{"role": "user", "content": "y" * 80}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="echo-a", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="echo-a", messages=[{"role": "wizard", "content": "y"}])


def test_invalid_json_is_400(serve):
    url = serve(EchoBackend())
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_engine_error_ends_stream_with_an_explicit_error(serve):
    backend = EchoBackend(fail_after=2)
    c = client(serve(backend))
    with pytest.raises(openai.APIError, match="engine 1 died"):
        list(c.completions.create(model="echo-a", prompt="abcdef", max_tokens=6, stream=True))
    with pytest.raises(openai.InternalServerError, match="engine 1 died"):
        c.completions.create(model="echo-a", prompt="abcdef", max_tokens=6)


def test_a_backend_that_cannot_take_a_request_now_is_a_503_to_retry(serve):
    """No live replica of the model (an engine down): 503 with Retry-After for a blocking
    request, a service_unavailable error event and [DONE] for a stream; never counted as served."""
    url = serve(EchoBackend(unavailable="model 'echo-a' has no live replica: engine 0 dead; retry later"))
    body = {"model": "echo-a", "prompt": "ab", "max_tokens": 3}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["message"].startswith("model 'echo-a' has no live replica")
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=10) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["type"] == "service_unavailable"
    assert 'vllm:request_success_total{model_name="echo-a"' not in httpx.get(f"{url}/metrics").text


def test_overload_is_503_and_recovers(serve):
    backend = EchoBackend(delay=0.05)
    url = serve(backend, max_outstanding=2)
    body = {"model": "echo-a", "prompt": "abc", "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=10) as h:
        with h.stream("POST", f"{url}/v1/completions", json=body) as r1, \
                h.stream("POST", f"{url}/v1/completions", json=body) as r2:
            assert r1.status_code == r2.status_code == 200
            r3 = h.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert r3.status_code == 503 and "overloaded" in r3.json()["error"]["message"]
            list(r1.iter_lines()), list(r2.iter_lines())
        assert h.post(f"{url}/v1/completions", json={**body, "stream": False}).status_code == 200


def test_api_key_guards_the_api_but_not_health(serve):
    url = serve(EchoBackend(), api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    assert client(url, key="s3cret").completions.create(model="echo-a", prompt="a", max_tokens=1).choices
    assert httpx.post(f"{url}/tokenize", json={"model": "echo-a", "prompt": "a"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_stream_disconnect_aborts_in_the_backend(serve):
    backend = EchoBackend(delay=0.05)
    url = serve(backend)
    body = {"model": "echo-a", "prompt": "abc", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert len(backend.live) == 1
    assert wait_for(lambda: not backend.live and len(backend.aborted) == 1)


def test_non_streaming_disconnect_aborts_in_the_backend(serve):
    backend = EchoBackend(delay=0.05)
    url = serve(backend)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": "echo-a", "prompt": "abc", "max_tokens": 60},
                   timeout=0.3)
    assert wait_for(lambda: not backend.live and len(backend.aborted) == 1)


def test_tokenize_detokenize_round_trip(serve):
    url = serve(EchoBackend())
    toks = httpx.post(f"{url}/tokenize", json={"model": "echo-a", "prompt": "héllo"}).json()
    assert toks["tokens"] == [BOS] + list("héllo".encode()) and toks["count"] == len(toks["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"model": "echo-a", "tokens": toks["tokens"][1:]}).json()
    assert back["prompt"] == "héllo"
    chat = httpx.post(f"{url}/tokenize", json={"model": "echo-a", "messages": [{"role": "user", "content": "q"}]})
    assert chat.json()["tokens"] == list(b"<user>q\n<assistant>")
    assert httpx.post(f"{url}/detokenize", json={"model": "echo-a", "tokens": [999]}).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={"model": "zzz", "prompt": "a"}).status_code == 404


def test_metrics_count_what_was_served(serve):
    url = serve(EchoBackend())
    c = client(url)
    c.completions.create(model="echo-a", prompt="abc", max_tokens=5)
    list(c.completions.create(model="echo-b", prompt="abc", max_tokens=3, stream=True))
    text = httpx.get(f"{url}/metrics").text
    assert 'vllm:generation_tokens_total{model_name="echo-a"} 5.0' in text
    assert 'vllm:generation_tokens_total{model_name="echo-b"} 3.0' in text
    assert 'vllm:prompt_tokens_total{model_name="echo-a"} 4.0' in text
    assert 'vllm:e2e_request_latency_seconds_count{model_name="echo-b"} 1.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0"} 0.0' in text


def test_continuous_usage_stats_counts_tokens_on_every_chunk(serve):
    url = serve(EchoBackend())
    body = {"model": "echo-a", "prompt": "abcd", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 4 and events[-1]["choices"] == []
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events)


def test_a_server_shutdown_ends_every_running_request_explicitly():
    """Stopping the server mid-generation (what SIGTERM does): an open stream gets an error event
    and [DONE], a blocking request a 503, each freed in the backend, instead of being cut off
    mid-chunk when uvicorn's grace period ran out."""
    backend = EchoBackend(delay=0.2)
    server = ServerThread(build_app(backend)).start()
    body = {"model": "echo-a", "prompt": "abc", "max_tokens": 60}
    results = {}

    def streamed():
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line]

    def blocking():
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        results["blocking"] = (r.status_code, r.json())

    threads = [threading.Thread(target=streamed), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    wait_for(lambda: len(backend.live) == 2)
    started = time.monotonic()
    server.stop()
    for t in threads:
        t.join(10)
    assert time.monotonic() - started < 3  # not uvicorn's 5 s grace period and a cancellation
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and "server shutting down" in events[-2] and '"server_error"' in events[-2]
    status, error = results["blocking"]
    assert status == 503 and "server shutting down" in error["error"]["message"]
    assert backend.live == set() and len(backend.aborted) == 2


def test_a_stream_admitted_before_a_shutdown_but_not_started_is_refused_when_it_starts():
    """Starlette runs a stream's body after its route returned: one admitted just before the
    drain is not running yet when the drain looks, so it checks on starting and ends with the
    shutdown error instead of generating while the server closes."""
    from paraflex.engine.core.sampling_params import SamplingParams
    from paraflex.gateway.app import Gateway
    from paraflex.gateway.generation import generate

    async def admitted_then_drained():
        gw = Gateway(EchoBackend(), 8)
        gw.admit()
        chunks = generate(gw.backend, gw.metrics, gw.cards["echo-a"], [97, 98], SamplingParams(max_tokens=5), "r",
                          gw.running)
        await gw.drain()
        return [c async for c in chunks], gw.backend.submitted

    chunks, submitted = asyncio.run(admitted_then_drained())
    assert [(c.error, c.unavailable) for c in chunks] == [(SHUTTING_DOWN, True)] and submitted == []
