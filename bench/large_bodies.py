"""Large request bodies against `paraflex serve`: does `/health` stay fast (issue 23)?

Place in the data flow: a client outside the server. It starts `paraflex serve --in-process` on
the demo config once per way of preparing large bodies, then, per burst, POSTs `--bodies`
(default 8) request bodies of ~8 MiB at once, all under the 413 limit and all refused for not
fitting the context (as such bodies are), while GETting `/health` every 50 ms; it reports the
`/health` latency (p50 / max) during the bursts and how long a burst took to be answered.

The ways (`--modes`; the server's gateway/body_workers.BodyWorkers set up before it starts):
- process: the shipped gateway: bodies over 256 KiB are decoded, validated and prepared in
  worker processes;
- thread: the same work on one worker thread of the server process (the gateway before);
- loop: every body decoded on the event loop (the gateway before that).

Bodies (`--kinds`): ids (a completions prompt of 2.75 M token ids), text (~8 MiB of text for
smollm2-135m, whose tokenizer releases the GIL; ~20 s per body to tokenize on this VM), chat
(250,000 one-word chat messages).

Usage: python bench/large_bodies.py [--modes process,thread,loop] [--kinds ids,chat] [--bursts 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from serve_process import ServeProcess  # noqa: E402
from soak import machine  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = {  # run in the server process before paraflex.cli.main (app.py builds its BodyWorkers then)
    "process": "",
    "thread": "from concurrent.futures import ThreadPoolExecutor; "
              "app.BodyWorkers = functools.partial(app.BodyWorkers, processes=1, executor=ThreadPoolExecutor); ",
    "loop": "app.BodyWorkers = functools.partial(app.BodyWorkers, large_body_bytes=1 << 40); ",
}


def launcher(mode: str) -> tuple[str, ...]:
    code = ("import functools, sys; import paraflex.gateway.app as app; " + SETUP[mode]
            + "from paraflex.cli import main; raise SystemExit(main(sys.argv[1:]))")
    return sys.executable, "-c", code


def bodies(kind: str) -> tuple[str, bytes]:
    if kind == "ids":
        return "/v1/completions", json.dumps({"model": "tiny-2l", "prompt": [65] * 2_750_000, "max_tokens": 1},
                                             separators=(",", ":")).encode()
    if kind == "text":
        return "/v1/completions", json.dumps({"model": "smollm2-135m", "prompt": "hello world " * 690_000,
                                              "max_tokens": 1}).encode()
    messages = [{"role": "user", "content": "hi"}] * 250_000
    return "/v1/chat/completions", json.dumps({"model": "smollm2-135m", "messages": messages, "max_tokens": 1},
                                              separators=(",", ":")).encode()


async def burst(url: str, path: str, body: bytes, n: int) -> tuple[list[float], float, list[int]]:
    """n concurrent POSTs of `body`; /health latencies meanwhile, the burst's time, the statuses."""
    health: list[float] = []
    async with httpx.AsyncClient(timeout=300) as client:
        async def post() -> int:
            response = await client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
            return response.status_code

        started = time.perf_counter()
        posts = [asyncio.create_task(post()) for _ in range(n)]
        while not all(p.done() for p in posts):
            t = time.perf_counter()
            await client.get(f"{url}/health")
            health.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)
        statuses = [p.result() for p in posts]
        return health, time.perf_counter() - started, statuses


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{ordered[len(ordered) // 2] * 1e3:7.1f} {p99 * 1e3:7.1f} {ordered[-1] * 1e3:8.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="process,thread,loop")
    ap.add_argument("--kinds", default="ids,chat", help="ids, text, chat (text: ~20 s per body to tokenize)")
    ap.add_argument("--bodies", type=int, default=8, help="concurrent large bodies per burst")
    ap.add_argument("--bursts", type=int, default=2, help="bursts per mode and kind")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "demo.yaml"))
    args = ap.parse_args(argv)
    kinds = {k: bodies(k) for k in args.kinds.split(",")}
    print(f"machine: {machine()}")
    print(f"{args.bodies} concurrent bodies per burst: " + ", ".join(
        f"{k} {len(b) / 2**20:.1f} MiB" for k, (_, b) in kinds.items()))
    print(f"{'mode':8} {'kind':5} {'health p50 ms':>14} {'p99':>7} {'max':>8} {'polls':>6} {'burst s':>8}  statuses  load avg")
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for mode in args.modes.split(","):
        server = ServeProcess(args.config, launcher=launcher(mode), who="large_bodies")
        try:
            for kind, (path, body) in kinds.items():
                for _ in range(args.bursts):
                    health, took, statuses = asyncio.run(burst(server.url, path, body, args.bodies))
                    codes = ",".join(sorted({str(s) for s in statuses}))
                    print(f"{mode:8} {kind:5} {quantiles(health):>31} {len(health):6} {took:8.1f}  {codes:8}  "
                          f"{open('/proc/loadavg').read().split()[0]}", flush=True)
        finally:
            server.stop()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    print(f"client CPU: {cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
