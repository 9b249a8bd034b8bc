"""bench/soak.py end to end over the scripted backend (tests/helpers/gateway_fakes.py) on a real
HTTP server: 20 streamed requests all complete, none is lost, the table is printed; and a
server that dies mid-run makes the soak count its requests lost and exit 1."""

from __future__ import annotations

import asyncio
import re

import httpx
from gateway_fakes import EchoBackend
from paraflex.gateway.app import build_app
from paraflex.gateway.server import ServerThread
from repo_paths import load_bench


def test_twenty_streams_all_complete_and_none_is_lost(capsys):
    soak = load_bench("soak")
    server = ServerThread(build_app(EchoBackend())).start()
    try:
        rc = soak.main(["--url", server.url, "-n", "20", "--concurrency", "8", "--timeout", "30"])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"^completed +20$", out, re.M) and re.search(r"^lost +0 \(-\)$", out, re.M), out
    assert "machine" in out and "client CPU" in out and "/health latency" in out


def test_a_server_that_is_gone_loses_every_request_and_fails_the_run(capsys):
    soak = load_bench("soak")
    server = ServerThread(build_app(EchoBackend())).start()
    url = server.url
    tally = soak.Tally()

    async def run():
        async with httpx.AsyncClient() as client:
            server.stop()
            await soak.one_request(client, url, "m", [1, 2], 4, 5.0, tally)

    asyncio.run(run())
    assert (tally.completed, tally.errors, tally.lost) == (0, 0, 1)
