"""Soak test of `paraflex serve`: many streamed requests, zero lost (issue 23).

Place in the data flow: a client outside the server. It targets a running server (--url) or
starts `paraflex serve --in-process` on CONFIG (--start; default the repo's demo config), then
sends N streamed /v1/completions (default 10,000; random token-id prompts over the models the
server lists) with at most --concurrency streams open at once (default 256), while a poller
GETs /health and /metrics once a second and records their latency.

Each request ends as one of:
- completed: the stream ended with `data: [DONE]` and carried no error event;
- error: an explicit answer (an HTTP error status such as 429/503, or an error event in the
  stream): the server said no, nothing was lost;
- lost: a stream that ended without `[DONE]` or an error event, a connection reset or refused,
  or a request that hung past --timeout.

Prints a table (the machine: CPU model and flags; counts; request and poll latencies; the
client's own CPU time as a share of one core, to show it was not the bottleneck) and exits 1
if any request was lost.

Usage: python bench/soak.py --start [CONFIG] [-n 10000] [--concurrency 256] [--max-tokens 8]
       python bench/soak.py --url http://127.0.0.1:8000 [-n 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from serve_process import ServeProcess  # noqa: E402
from paraflex.cpu_info import machine_line  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOST = (httpx.TransportError,)  # connection reset / refused / protocol error: the request vanished


@dataclass
class Tally:
    """What happened to the requests, and the latencies seen."""

    completed: int = 0
    errors: int = 0
    lost: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    lost_kinds: dict[str, int] = field(default_factory=dict)
    request_s: list[float] = field(default_factory=list)
    poll_s: dict[str, list[float]] = field(default_factory=lambda: {"/health": [], "/metrics": []})
    poll_failures: int = 0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def lose(self, kind: str) -> None:
        self.lost += 1
        self.lost_kinds[kind] = self.lost_kinds.get(kind, 0) + 1


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float, tally: Tally) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    tally.error(f"HTTP {response.status_code}")
                    return
                done = failed = False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                    elif '"error"' in data and "error" in json.loads(data):
                        failed = True
        if failed:
            tally.error("error event")
        elif done:
            tally.completed += 1
            tally.request_s.append(time.perf_counter() - started)
        else:
            tally.lose("stream ended without [DONE]")
    except TimeoutError:
        tally.lose(f"hung past {timeout:g} s")
    except LOST as exc:
        tally.lose(type(exc).__name__)


async def poll(url: str, tally: Tally, stop: asyncio.Event, headers: dict) -> None:
    """GET /health and /metrics once a second on a client of their own, recording latency."""
    async with httpx.AsyncClient(timeout=30.0, headers=headers) as client:
        while not stop.is_set():
            for path in ("/health", "/metrics"):
                started = time.perf_counter()
                try:
                    await client.get(f"{url}{path}")
                    tally.poll_s[path].append(time.perf_counter() - started)
                except httpx.HTTPError:
                    tally.poll_failures += 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def soak(url: str, num_requests: int, concurrency: int, max_tokens: int, timeout: float,
               api_key: str | None = None, seed: int = 0) -> Tally:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tally = Tally()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers) as client:
        models = [m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]]
        rng = random.Random(seed)
        stop = asyncio.Event()
        poller = asyncio.create_task(poll(url, tally, stop, headers))
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> None:
            async with gate:
                prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 32))]
                await one_request(client, url, models[i % len(models)], prompt, max_tokens, timeout, tally)

        await asyncio.gather(*(gated(i) for i in range(num_requests)))
        stop.set()
        await poller
    return tally


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"p50 {ordered[len(ordered) // 2] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {ordered[-1] * 1e3:.1f} ms"


def report(tally: Tally, wall_s: float, cpu_s: float, args) -> str:
    kinds = lambda d: ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    rows = [
        ("machine", machine_line()),
        ("requests", f"{args.num_requests} streamed, at most {args.concurrency} at once, max_tokens {args.max_tokens}"),
        ("completed", str(tally.completed)),
        ("explicit errors", f"{tally.errors} ({kinds(tally.error_kinds)})"),
        ("lost", f"{tally.lost} ({kinds(tally.lost_kinds)})"),
        ("wall time", f"{wall_s:.1f} s ({args.num_requests / wall_s:.1f} requests/s)"),
        ("request latency", _quantiles(tally.request_s)),
        ("/health latency", _quantiles(tally.poll_s["/health"])),
        ("/metrics latency", _quantiles(tally.poll_s["/metrics"])),
        ("poll failures", str(tally.poll_failures)),
        ("client CPU", f"{cpu_s:.1f} s = {100 * cpu_s / wall_s:.0f}% of one core"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=os.path.join(REPO, "configs", "demo.yaml"),
                   help="config to serve with --start (default: the demo)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="soak a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--start", action="store_true", help="start `paraflex serve --in-process CONFIG` for the run")
    p.add_argument("-n", "--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=256, help="streams open at once (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="a request longer than this is lost (hung)")
    p.add_argument("--api-key", default=os.environ.get("PARAFLEX_API_KEY") or None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server = ServeProcess(args.config, max_outstanding=max(256, args.concurrency), who="soak") if args.start else None
    url = server.url if server else args.url.rstrip("/")
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        tally = asyncio.run(soak(url, args.num_requests, args.concurrency, args.max_tokens, args.timeout,
                                 args.api_key, args.seed))
        wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        if server:
            server.stop()
    print(report(tally, wall_s, cpu_s, args))
    return 1 if tally.lost else 0


if __name__ == "__main__":
    sys.exit(main())
