"""Large request bodies are decoded and validated off the event loop: `/health` is answered
while an ~8 MiB body is being decoded (asserted by ordering, not by timing). Over the scripted
backend (tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from gateway_fakes import EchoBackend
from paraflex.gateway import request_body
from paraflex.gateway.api_error import ApiError
from paraflex.gateway.app import build_app
from paraflex.gateway.protocol import CompletionRequest
from paraflex.gateway.request_body import MAX_BODY_BYTES
from paraflex.gateway.server import ServerThread


def test_health_is_answered_while_a_large_body_is_decoded(monkeypatch):
    decoding, health_answered = threading.Event(), threading.Event()
    answered_meanwhile: list[bool] = []
    real_decode = request_body.decode

    def decode_after_health(body, schema):
        decoding.set()
        answered_meanwhile.append(health_answered.wait(30))  # the wait is a hang guard only
        return real_decode(body, schema)

    monkeypatch.setattr(request_body, "decode", decode_after_health)
    body = json.dumps({"model": "echo-a", "prompt": [65] * 2_700_000}, separators=(",", ":")).encode()  # 2.7 M token ids
    assert MAX_BODY_BYTES - (1 << 20) < len(body) <= MAX_BODY_BYTES
    server = ServerThread(build_app(EchoBackend())).start()
    big = {}
    try:
        def post_big():
            big["response"] = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                                         headers={"content-type": "application/json"})

        poster = threading.Thread(target=post_big)
        poster.start()
        assert decoding.wait(60)
        health = httpx.get(f"{server.url}/health", timeout=20)  # before: the loop was busy decoding
        health_answered.set()
        poster.join(60)
    finally:
        health_answered.set()
        server.stop()
    assert health.status_code == 200 and answered_meanwhile == [True]
    assert big["response"].status_code == 400 and "leave no room" in big["response"].json()["error"]["message"]


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
