"""The gateway's connections as raw sockets see them: keep-alive outlives the clients' pool
expiry; a request whose headers or body stall is closed (408 for a body) after the read
timeout, and a client that goes away mid-body is one log line, not a traceback. Over the
scripted backend (tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

import polling

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


READ_TIMEOUT_S = 0.5
PARTIAL_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"model")  # 7 of 100 bytes


@pytest.fixture
def quick_url():
    """A server with a 0.5 s read timeout."""
    server = ServerThread(build_app(EchoBackend()), read_timeout=READ_TIMEOUT_S).start()
    yield server.url
    server.stop()


def test_a_body_shorter_than_its_content_length_is_answered_408_and_closed(quick_url):
    with _connect(quick_url) as sock:
        sock.sendall(PARTIAL_BODY)
        response = read_response(sock)
        assert response.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in response.lower()
        error = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "invalid_request_error" and "request body incomplete" in error["message"]
        assert sock.recv(1) == b""  # closed


def test_headers_sent_a_byte_at_a_time_are_cut_off(quick_url):
    """The client keeps trickling (the connection never idles) yet is closed while it does."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400
    closed = threading.Event()
    with _connect(quick_url) as sock:
        def trickle():
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return
                if closed.wait(0.05):
                    return
        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            got = sock.recv(65536)  # blocks until the server closes (or, before, answers)
        except ConnectionResetError:
            # A byte that lands after the server's close makes its kernel answer with a
            # reset instead of an orderly end: closed all the same, and with no answer.
            got = b""
        closed.set()
        sender.join(30)
    assert got == b""


def test_a_connection_that_sends_nothing_is_closed(quick_url):
    with _connect(quick_url) as sock:
        assert sock.recv(1) == b""


def test_the_timeouts_leave_a_well_behaved_client_alone(quick_url):
    with _connect(quick_url) as sock:
        for _ in range(2):
            sock.sendall(HEALTH)
            assert read_response(sock).startswith(b"HTTP/1.1 200")


def test_a_client_gone_mid_body_is_one_log_line_not_a_traceback(url, caplog):
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            with _connect(url) as sock:
                sock.sendall(PARTIAL_BODY)
                time.sleep(0.2)
            polling.wait_for(lambda: any("went away" in r.getMessage() for r in caplog.records), timeout=10)
            time.sleep(0.2)  # anything logged after the line
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert not any(r.exc_info for r in caplog.records), lines
    [line] = [m for m in lines if "went away" in m]
    assert "after sending 7 of 100 body bytes of POST /v1/completions" in line
