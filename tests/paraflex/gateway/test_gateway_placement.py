"""GET/POST /v1/placement over a real in-process backend: the key is required, a change posted
while streams run leaves every stream complete, the refusals answer 400/403/409 with nothing
changed, and /metrics counts the actions, the moved bytes and each model's arrival rate."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from live_placement_case import KV, NEW, OLD, live_config, placement

from paraflex.gateway.app import build_app
from paraflex.gateway.server import ServerThread
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.in_process_backend import InProcessBackend

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 48


@pytest.fixture
def served():
    backend = InProcessBackend(LLMCluster(live_config(), placement(OLD), kv_bytes=KV))
    backend.changer.drain_timeout_s = 0.0  # what still runs on the removed replica moves by recompute
    server = ServerThread(build_app(backend, api_key=KEY)).start()
    yield server.url, backend
    server.stop()
    asyncio.run(backend.close())


def _stream(url: str, i: int) -> tuple[str | None, int | None]:
    """One streamed completion of tiny-2l: (its finish reason, its completion tokens)."""
    body = {"model": "tiny-2l", "prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    finish, tokens = None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["finish_reason"]:
                finish = event["choices"][0]["finish_reason"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return finish, tokens


def _post(url: str, doc, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/placement", content=json.dumps(doc), timeout=120,
                      headers={**headers, "Content-Type": "application/json"})


def test_a_change_posted_while_streams_run_leaves_every_stream_complete(served):
    url, backend = served
    assert httpx.get(f"{url}/v1/placement").status_code == 401
    got = httpx.get(f"{url}/v1/placement", headers=AUTH)
    assert got.status_code == 200 and got.json() == placement(OLD).to_dict()
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, url, i) for i in range(8)]
        changed = _post(url, placement(NEW).to_dict())
        streams += [pool.submit(_stream, url, i) for i in range(8, 12)]
        results = [s.result(timeout=120) for s in streams]
    assert changed.status_code == 200, changed.text
    report = changed.json()
    assert [(a["op"], a["engines"]) for a in report["actions"]] == [("add", [1]), ("remove", [2])]
    assert report["placement"] == placement(NEW).to_dict()
    assert results == [("length", MAX_TOKENS)] * 12
    assert httpx.get(f"{url}/v1/placement", headers=AUTH).json() == placement(NEW).to_dict()
    text = httpx.get(f"{url}/metrics").text
    assert 'paraflex:placement_actions_total{op="add",outcome="done"} 1.0' in text
    assert 'paraflex:placement_actions_total{op="remove",outcome="done"} 1.0' in text
    assert f"paraflex:placement_moved_bytes_total {float(report['moved_bytes'])}" in text
    rate = float(re.search(r'paraflex:arrival_rate\{model_name="tiny-2l"\} (\S+)', text).group(1))
    assert rate > 0
    assert 'paraflex:arrival_rate{model_name="tiny-4l"} 0.0' in text


def test_refusals_answer_their_status_and_change_nothing(served):
    url, backend = served
    old = placement(OLD).to_dict()
    assert _post(url, placement(NEW).to_dict(), headers={}).status_code == 401
    bad_json = httpx.post(f"{url}/v1/placement", content=b"{", headers={**AUTH, "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    other = _post(url, placement({"tiny-2l": OLD["tiny-2l"]}).to_dict())
    assert other.status_code == 400 and "places models tiny-2l but live-test has tiny-2l, tiny-4l" in other.text
    malformed = _post(url, {**old, "version": 7})
    assert malformed.status_code == 400 and "version" in malformed.text
    too_big = _post(url, placement(NEW, kv_bytes=2 << 30).to_dict())
    assert too_big.status_code == 409 and "cannot fit" in too_big.text
    assert httpx.get(f"{url}/v1/placement", headers=AUTH).json() == old
    keyless = TestClient(build_app(backend), base_url="http://localhost")
    refused = keyless.post("/v1/placement", json=placement(NEW).to_dict())
    assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]
    assert keyless.get("/v1/placement").json() == old
