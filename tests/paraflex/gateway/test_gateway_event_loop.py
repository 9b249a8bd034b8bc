"""Large request bodies are decoded, validated and prepared in worker processes
(gateway/body_workers.py): `/health` is answered while large bodies are held in the middle of
their preparation (asserted by ordering, not by timing); a large body gets exactly the answer
its small twin gets; what a worker sends back for a refused 8 MiB body is small; the workers
stop with the server. Over the scripted backend (tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import threading

import httpx
import pytest

from gateway_fakes import EchoBackend, GatedTokenizer
from paraflex.gateway import body_workers, request_body
from paraflex.gateway.api_error import ApiError
from paraflex.gateway.app import build_app
from paraflex.gateway.body_workers import LARGE_BODY_BYTES, adopt_cards, prepare_body
from paraflex.gateway.protocol import CompletionRequest
from paraflex.gateway.request_body import MAX_BODY_BYTES
from paraflex.gateway.request_prep import Generation
from paraflex.gateway.server import ServerThread

JSON = {"content-type": "application/json"}


def test_health_is_answered_while_large_bodies_are_prepared_in_another_process(tmp_path):
    started, gate = tmp_path / "encoding", tmp_path / "open"
    server = ServerThread(build_app(EchoBackend(tokenizer=GatedTokenizer(str(started), str(gate))))).start()
    body = json.dumps({"model": "echo-a", "prompt": "x" * (LARGE_BODY_BYTES + 1000)}).encode()
    answers: list[httpx.Response] = []
    try:
        def post_big():
            answers.append(httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=120))

        posters = [threading.Thread(target=post_big) for _ in range(3)]
        for poster in posters:
            poster.start()
        for _ in range(6000):  # a worker is inside encode(), holding the big bodies (hang guard: 60 s)
            if started.exists() and started.read_text():
                break
            threading.Event().wait(0.01)
        health = httpx.get(f"{server.url}/health", timeout=30)
        gate_was_closed = not gate.exists()
        gate.touch()
        for poster in posters:
            poster.join(120)
    finally:
        gate.touch()
        server.stop()
    assert health.status_code == 200 and gate_was_closed
    assert int(started.read_text()) != os.getpid()  # prepared in a worker process
    assert [a.status_code for a in answers] == [400] * 3
    assert all("leave no room" in a.json()["error"]["message"] for a in answers)


SAME_ANSWER_BODIES = [
    {"model": "echo-a", "prompt": [65, 66], "max_tokens": 3},
    {"model": "echo-a", "prompt": "hello", "max_tokens": 2, "stop": ["l"]},
    {"model": "echo-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"model": "echo-a", "prompt": "x", "temperature": "1"},
    {"model": "nope", "prompt": "x"},
    {"model": "echo-a", "prompt": [65, 999]},
    {"model": "echo-a", "prompt": [65] * 100},
    {"model": "echo-a", "prompt": [65], "max_tokens": 64},
    {"model": "echo-a", "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "echo-a", "messages": [{"role": "user", "content": "x" * 100}]},
    {"model": "echo-a", "prompt": "a\ud800"},
    {"model": "echo-a", "prompt": "hi", "path": "/tokenize"},
    {"model": "echo-a", "messages": [{"role": "user", "content": "hi"}], "path": "/tokenize"},
    {"model": "echo-a", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "path": "/tokenize"},
    {"model": "echo-a", "tokens": [104, 105, 256], "path": "/detokenize"},
    {"model": "echo-a", "tokens": [104, -1], "path": "/detokenize"},
    b'{"model": "echo-a", "prompt":',
    b"[1, 2]",
]


@pytest.fixture(scope="module")
def echo_server():
    server = ServerThread(build_app(EchoBackend())).start()
    yield server
    server.stop()


def _comparable(response: httpx.Response):
    body = response.json()
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return response.status_code, body


@pytest.mark.parametrize("request_body_", SAME_ANSWER_BODIES, ids=range(len(SAME_ANSWER_BODIES)))
def test_a_large_body_gets_the_answer_of_its_small_twin(echo_server, request_body_):
    if isinstance(request_body_, bytes):
        path, raw = "/v1/completions", request_body_
    else:
        fields = dict(request_body_)
        path = fields.pop("path", "/v1/chat/completions" if "messages" in fields else "/v1/completions")
        raw = json.dumps(fields).encode()
    padded = raw + b" " * (LARGE_BODY_BYTES + 1)  # JSON's trailing whitespace: the same request, large
    answers = [httpx.post(f"{echo_server.url}{path}", content=b, headers=JSON, timeout=60) for b in (raw, padded)]
    assert _comparable(answers[0]) == _comparable(answers[1])


def test_a_worker_sends_back_little_for_an_8_mib_body(monkeypatch):
    monkeypatch.setattr(body_workers, "worker_cards", {})
    adopt_cards(pickle.dumps({c.name: c for c in EchoBackend().cards}))
    refused = json.dumps({"model": "echo-a", "prompt": [65] * 2_700_000}, separators=(",", ":")).encode()
    assert MAX_BODY_BYTES - (1 << 20) < len(refused) <= MAX_BODY_BYTES
    with pytest.raises(ApiError) as err:
        prepare_body(refused, CompletionRequest)
    back = pickle.loads(pickle.dumps(err.value))
    assert len(pickle.dumps(err.value)) < 1024
    assert (back.status, back.param, back.message) == (400, "prompt", err.value.message)
    assert "2700000 tokens leave no room" in back.message
    accepted = json.dumps({"model": "echo-a", "prompt": [65] * 10, "user": "u" * (MAX_BODY_BYTES // 2)}).encode()
    job = prepare_body(accepted, CompletionRequest)
    assert isinstance(job, Generation) and job.ids == [65] * 10 and len(pickle.dumps(job)) < 2048


def test_the_worker_processes_stop_with_the_server():
    others = set(multiprocessing.active_children())  # e.g. the workers of echo_server
    server = ServerThread(build_app(EchoBackend())).start()
    body = json.dumps({"model": "echo-a", "prompt": [65] * 200_000}).encode()
    try:
        answer = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=60)
        workers = set(multiprocessing.active_children()) - others
    finally:
        server.stop()
    assert answer.status_code == 400 and workers  # a worker process answered it
    assert not [p for p in workers if p.is_alive()]


@pytest.mark.parametrize("raw, surrogate", [
    (b'{"model":"m","prompt":"a\\ud800"}', True),
    (b'{"model":"m","prompt":"a\\uDFFF"}', True),
    ('{"model":"m","prompt":"a\ud800"}'.encode("utf-8", "surrogatepass"), True),  # encoded, no escape
    ('{"model":"m","prompt":"a\ud800"}'.encode("utf-16", "surrogatepass"), True),
    (b'{"model":"m","prompt":"a\\\\ud800"}', False),  # an escaped backslash: the text \ud800
    (b'{"model":"m","prompt":"a\\ud83d\\ude00"}', False),  # a pair: one emoji
])
def test_decoding_finds_every_unpaired_surrogate_without_walking_clean_bodies(raw, surrogate):
    if surrogate:
        with pytest.raises(ApiError, match="unpaired UTF-16 surrogate") as err:
            request_body.decode(raw, CompletionRequest)
        assert err.value.param == "prompt"
    else:
        assert request_body.decode(raw, CompletionRequest).model == "m"
