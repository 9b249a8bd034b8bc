"""The gateway's connections as raw sockets see them: keep-alive outlives the clients' pool
expiry. Over the scripted backend (tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import socket
import time

import pytest

from gateway_fakes import EchoBackend
from paraflex.gateway.app import build_app
from paraflex.gateway.server import KEEP_ALIVE_S, ServerThread, server_config

HTTPX_POOL_EXPIRY_S = 5.0  # httpx's (and so the OpenAI client's) keepalive_expiry


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (status line, headers, a Content-Length body); b"" when the
    server closed the connection instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def url():
    server = ServerThread(build_app(EchoBackend())).start()
    yield server.url
    server.stop()


def test_keep_alive_outlives_the_clients_pool_expiry():
    assert server_config(build_app(EchoBackend())).timeout_keep_alive == KEEP_ALIVE_S >= 10 * HTTPX_POOL_EXPIRY_S


@pytest.mark.slow
def test_a_connection_idle_past_the_clients_pool_expiry_still_answers(url):
    """Before: uvicorn closed it after 5 s, so a client reusing it then got a reset."""
    with _connect(url) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HTTPX_POOL_EXPIRY_S + 0.5)
        sock.sendall(HEALTH)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
