"""What a web page could make a browser send to a keyless server on loopback: a cross-origin
simple POST (a `text/plain` or form body needs no CORS preflight) gets a 415, and a DNS
rebinding (the page's own domain re-pointed at 127.0.0.1, sent as `Host`) a 400; /metrics
needs the API key only when asked to. Over the scripted backend (tests/helpers/gateway_fakes.py),
and `paraflex serve`'s flags reaching the app."""

from __future__ import annotations

import httpx
import pytest
import yaml

from gateway_cluster import config_dict, make_placement
from gateway_fakes import EchoBackend
from paraflex.cli import main
from paraflex.gateway.app import build_app
from paraflex.gateway.server import ServerThread

BODY = b'{"model": "echo-a", "prompt": "hi", "max_tokens": 2}'


@pytest.fixture
def serve():
    """serve(**build_app kwargs) -> (base URL, backend); every server stops at teardown."""
    servers = []

    def start(**kwargs):
        backend = EchoBackend()
        servers.append(ServerThread(build_app(backend, **kwargs)).start())
        return servers[-1].url, backend

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_post_bodies_not_declared_json_are_415(serve, path, content_type):
    url, backend = serve()
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{url}{path}", content=BODY, headers=headers)
    assert r.status_code == 415
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "Content-Type: application/json" in error["message"]
    assert backend.submitted == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_bodies_are_served(serve, content_type):
    url, _ = serve()
    r = httpx.post(f"{url}/v1/completions", content=BODY, headers={"content-type": content_type})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "attacker.localhost.evil.example",
                                  "127.0.0.1.evil.example"])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
                                          ("POST", "/v1/completions")])
def test_a_host_that_is_not_a_name_of_the_server_is_400(serve, host, method, path):
    url, backend = serve()
    r = httpx.request(method, f"{url}{path}", content=BODY, headers={"host": host, "content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(f"Host: {host.split(':')[0]!r} is not a name of this server")
    assert "--allowed-host" in error["message"] and backend.submitted == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:9", "localhost.",
                                  "[::1]", "[::1]:8000", "10.1.2.3:80", "[fe80::1]"])
def test_loopback_names_and_ip_addresses_are_accepted(serve, host):
    url, _ = serve()
    assert httpx.get(f"{url}/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_add_names_and_star_accepts_any(serve):
    url, _ = serve(allowed_hosts=("api.example.com", "gpu-box"))
    assert httpx.get(f"{url}/health", headers={"host": "API.example.com:443"}).status_code == 200
    assert httpx.get(f"{url}/health", headers={"host": "gpu-box"}).status_code == 200
    assert httpx.get(f"{url}/health", headers={"host": "other.example.com"}).status_code == 400
    url, _ = serve(allowed_hosts=("*",))
    assert httpx.get(f"{url}/health", headers={"host": "other.example.com"}).status_code == 200


def test_metrics_stay_open_with_a_key_unless_asked(serve):
    url, _ = serve(api_key="k")
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
    url, _ = serve(api_key="k", metrics_require_key=True)
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"authorization": "Bearer k"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_serve_passes_its_host_flags_to_the_app(tmp_path, monkeypatch):
    """`paraflex serve --host NAME --allowed-host ... --metrics-require-key`: the app it serves
    accepts those names and guards /metrics (the engines replaced by the scripted backend)."""
    from paraflex.commands import serve as serve_command
    from paraflex.gateway import server

    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(config_dict()))
    placement = tmp_path / "placement.json"
    make_placement().save(placement)
    served = {}
    monkeypatch.setattr(serve_command, "start_backend", lambda config, placement, args: EchoBackend())
    monkeypatch.setattr(server, "serve", lambda app, sock, announce=None, **kw: served.update(app=app))
    assert main(["serve", str(cfg), "--placement", str(placement), "--in-process", "--host", "localhost",
                 "--port", "0", "--api-key", "k", "--metrics-require-key", "--allowed-host", "gpu-box"]) == 0
    thread = ServerThread(served["app"]).start()
    try:
        assert httpx.get(f"{thread.url}/health", headers={"host": "gpu-box"}).status_code == 200
        assert httpx.get(f"{thread.url}/health", headers={"host": "elsewhere"}).status_code == 400
        assert httpx.get(f"{thread.url}/metrics").status_code == 401
    finally:
        thread.stop()


def test_metrics_require_key_needs_a_key(capsys, monkeypatch):
    from cli_errors import error_line

    monkeypatch.delenv("PARAFLEX_API_KEY", raising=False)
    assert main(["serve", "--metrics-require-key", "--in-process", "--port", "0"]) == 2
    assert error_line(capsys, "serve").startswith("--metrics-require-key: there is no key to require")
