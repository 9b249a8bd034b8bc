"""SIGTERM's drain window, load-balancer friendly: `/health` answers 503 at once and new
requests 503 with Retry-After while running requests finish; then the listener closes (when
the window ends, or at a second SIGTERM). Over the scripted backend
(tests/helpers/gateway_fakes.py), with `ServerThread.terminate` doing what SIGTERM does."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

import polling
from gateway_fakes import EchoBackend
from paraflex.gateway.app import SHUTTING_DOWN, build_app
from paraflex.gateway.server import ServerThread

BODY = {"model": "echo-a", "prompt": "abc", "max_tokens": 40}


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_then_closes_the_listener_on_a_second_sigterm():
    backend = EchoBackend(delay=0.05)
    server = ServerThread(build_app(backend), drain_s=600).start()
    stream = {}

    def streamed():
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
            stream["lines"] = [line for line in r.iter_lines() if line]

    try:
        runner = threading.Thread(target=streamed)
        runner.start()
        assert polling.wait_for(lambda: backend.live, timeout=10)
        server.terminate()
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["shutting_down"] is True
        for method, path in [("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/v1/models")]:
            r = httpx.request(method, f"{server.url}{path}", json=BODY)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            assert r.json()["error"] == {"message": SHUTTING_DOWN, "type": "service_unavailable", "param": None,
                                         "code": None}
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        runner.join(30)
        lines = stream["lines"]  # the running request finished, whole
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        assert server.running() and not _refused(server.url)  # still listening: the window is open
        server.terminate()  # a second SIGTERM: close now
        assert polling.wait_for(lambda: not server.running(), timeout=30)
        assert _refused(server.url)
    finally:
        server.stop()


def test_the_drain_window_ends_by_itself():
    server = ServerThread(build_app(EchoBackend()), drain_s=0.2).start()
    try:
        server.terminate()
        assert polling.wait_for(lambda: not server.running(), timeout=30)
        assert _refused(server.url)
    finally:
        server.stop()


@pytest.mark.parametrize("drain_s", [0, 5])
def test_stop_and_a_zero_window_close_at_once(drain_s):
    """No drain window (`--drain-seconds 0`, or stop()): the listener closes at once."""
    server = ServerThread(build_app(EchoBackend()), drain_s=drain_s).start()
    try:
        if drain_s:
            server.stop()
        else:
            server.terminate()
        assert polling.wait_for(lambda: not server.running(), timeout=30)
        assert _refused(server.url)
    finally:
        server.stop()
