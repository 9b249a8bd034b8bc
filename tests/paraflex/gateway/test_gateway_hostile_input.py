"""What a careless or hostile client sends, found by a sweep of a running gateway: each is a
4xx naming the field and the fix (never a 500, a traceback or a hang), and the server keeps
serving. Over the scripted backend (tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway_fakes import EchoBackend
from paraflex.gateway.app import build_app
from paraflex.gateway.request_body import MAX_BODY_BYTES
from paraflex.gateway.server import ServerThread


@pytest.fixture(scope="module")
def url():
    server = ServerThread(build_app(EchoBackend(), max_outstanding=4)).start()
    yield server.url
    server.stop()


def _post(url, path, raw: bytes | None = None, **json_body) -> httpx.Response:
    if raw is not None:
        return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(f"{url}{path}", json=json_body, timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model":"echo-a","prompt":"\\ud800","max_tokens":2}', "prompt"),
    ("/v1/chat/completions", b'{"model":"echo-a","messages":[{"role":"user","content":"a\\udc00"}]}',
     "messages[0].content"),
    ("/tokenize", b'{"model":"echo-a","prompt":"\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model":"echo-a","prompt":"a","\\ud800":1}', "body"),
])
def test_unpaired_surrogates_are_400_naming_the_field(url, path, body, param):
    err = _error(_post(url, path, raw=body), 400)
    assert err["param"] == param and "unpaired UTF-16 surrogate" in err["message"]


@pytest.mark.parametrize("body, detail", [
    (b'{"model":"echo-a","prompt":"a","max_tokens":' + b"9" * 5000 + b"}", "Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model":"echo-a","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_json_python_cannot_read_is_400(url, body, detail):
    err = _error(_post(url, "/v1/completions", raw=body), 400)
    assert err["message"].startswith("request body is not valid JSON") and detail in err["message"]


def test_a_body_over_the_limit_is_413_before_it_is_read(url):
    big = b'{"model":"echo-a","prompt":"' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    err = _error(_post(url, "/v1/completions", raw=big), 413)
    assert "request body is over 8 MiB" in err["message"]

    def chunks():  # no content-length: counted as it streams
        yield b'{"model":"echo-a","prompt":"'
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert _error(r, 413)["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "a", "stream": 1}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt", "list of token ids"),
    ("/v1/completions", {"prompt": 1.5}, "prompt", "a string or a list of token ids"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs", "integer count"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": "3"},
     "max_completion_tokens", "valid integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**6},
     "max_completion_tokens", "ask for at most"),
    ("/tokenize", {"messages": []}, "messages", "at least 1"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]", "valid integer"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed", "2**64 - 1"),
    ("/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
])
def test_ill_typed_fields_are_400_naming_the_field_and_the_fix(url, path, body, param, words):
    err = _error(_post(url, path, model="echo-a", **body), 400)
    assert err["param"] == param and words in err["message"]


def test_openai_shapes_for_routes_methods_and_model_retrieval(url):
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
    assert c.models.retrieve("echo-a").id == "echo-a"
    with pytest.raises(openai.NotFoundError, match="echo-a"):
        c.models.retrieve("nope")
    assert "no route /v1/nothing" in _error(httpx.get(f"{url}/v1/nothing"), 404)["message"]
    assert _error(httpx.get(f"{url}/v1/completions"), 405)["message"] == "GET is not allowed on /v1/completions"
    assert httpx.head(f"{url}/health").status_code == 200


def test_the_bearer_scheme_is_case_insensitive_and_overload_says_when_to_retry():
    server = ServerThread(build_app(EchoBackend(delay=0.2), api_key="k", max_outstanding=1)).start()
    try:
        body = {"model": "echo-a", "prompt": "abc", "max_tokens": 8}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"authorization": "bearer k"}).status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"authorization": "Basic k"}).status_code == 401
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          headers={"authorization": "Bearer k"}) as first:
            busy = httpx.post(f"{server.url}/v1/completions", json=body, headers={"authorization": "Bearer k"})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            list(first.iter_lines())
    finally:
        server.stop()


def test_the_server_still_serves_after_all_of_it(url):
    r = _post(url, "/v1/completions", model="echo-a", prompt="hello", max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
