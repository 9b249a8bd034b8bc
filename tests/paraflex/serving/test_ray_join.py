"""Joining a Ray cluster (`paraflex serve --ray-address`): one line with the reason and the fix
when nothing answers at the address or the head refuses this process (token authentication)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from paraflex.errors import UserError
from paraflex.serving import ray_join

from repo_paths import REPO


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again once the with-block ends


@pytest.mark.parametrize("address", ["10.0.0.1", "10.0.0.1:", ":6379", "host:port", "h:70000"])
def test_a_malformed_address_names_the_expected_form(address):
    with pytest.raises(UserError, match="HOST:PORT"):
        ray_join.split_address(address)


def test_ipv6_address():
    assert ray_join.split_address("[::1]:6379") == ("::1", 6379)


def test_serve_at_an_address_where_nothing_listens_says_how_to_start_the_head():
    """In a fresh process: where Ray is already initialised (the test session's), serve uses it."""
    port = _closed_port()
    done = subprocess.run([sys.executable, "-m", "paraflex", "serve", str(REPO / "configs" / "demo.yaml"),
                           "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("paraflex serve: error: ")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    line = errors[0]
    assert f"--ray-address 127.0.0.1:{port}: nothing answers there" in line
    assert f"ray start --head --port={port}" in line and "docs/cluster.md" in line


@pytest.fixture
def listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _refused(**kwargs):
    raise ConnectionError("Failed to connect to Ray cluster")  # what Ray 2.60 raises after ~20 s


def test_a_refused_join_without_token_mode_names_ray_auth_mode(listening, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(ray_join.ray, "init", _refused)
    with pytest.raises(UserError) as info:
        ray_join.join_ray(listening)
    msg = str(info.value)
    assert msg.startswith(f"--ray-address {listening}: cannot join") and "\n" not in msg
    assert "RAY_AUTH_MODE=token" in msg and "ray get-auth-token" in msg


def test_a_refused_join_in_token_mode_says_the_token_differs(listening, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setattr(ray_join.ray, "init", _refused)
    with pytest.raises(UserError, match="token was refused"):
        ray_join.join_ray(listening)
