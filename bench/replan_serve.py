"""Live re-planning on the real CPU server: a popularity shift, static placement vs
`paraflex serve --replan-interval` (issue 22).

Place in the data flow: a client outside the server, like bench/serve_load.py (whose open-loop
client, bench/serve_client.py, it reuses). For each arm it starts `paraflex serve --in-process`
on CONFIG (default: the demo config) with the planner's placement for the config's rates
(bench/serve_process.py), then sends one open-loop Poisson run of token-id prompts with fixed
output lengths: the first half at the config's per-model rates, the second half with the most
and least popular models' rates swapped (the most popular model changes halfway). Arms:
- static: the start placement serves throughout;
- live: `--replan-interval S`: the server's re-planner moves replicas after the shift.

Per arm it reports SLO attainment (TTFT and TPOT within the model's `slo_ttft_ms`/`slo_tbt_ms`,
or --slo-ttft-ms/--slo-tpot-ms for models without them), goodput (requests/s meeting both), P99
TTFT before and after the shift (by arrival), the placement actions from /metrics
(`paraflex:placement_actions_total`) and lost requests (a stream without [DONE] or an explicit
error: a reset, a cut stream, a hang past --request-timeout). Exits 1 if any request was lost.
`--tiny` is the CI variant (tests/bench/test_replan_serve.py): the demo's tiny models only, a
few seconds per arm; it checks the pipeline and zero lost, its timings mean nothing.

Usage: python bench/replan_serve.py [CONFIG] [--duration 80] [--rate 3] [--replan-interval 10]
       python bench/replan_serve.py --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

import httpx
import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from serve_client import Result, arrivals, open_loop, prompts_for  # noqa: E402
from serve_process import ServeProcess  # noqa: E402

from paraflex.config.schema import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "demo.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=DEMO)
    p.add_argument("--duration", type=float, default=80.0, help="seconds of arrivals per arm (the shift at half)")
    p.add_argument("--rate", type=float, default=3.0, help="total requests/s, split by the models' rates")
    p.add_argument("--replan-interval", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO of models without slo_ttft_ms")
    p.add_argument("--slo-tpot-ms", type=float, default=500.0, help="TPOT SLO of models without slo_tbt_ms")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engines")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CI variant: tiny models, a short run, checks 0 lost")
    p.add_argument("--out", help="write the per-arm numbers as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.duration, args.rate, args.replan_interval, args.output_len = 12.0, 4.0, 3.0, 4
    return args


def tiny_config(path: str, folder: str) -> str:
    """`path` without its GGUF models (a faster start), written into `folder`."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["models"] = [m for m in raw["models"] if "gguf" not in m]
    out = os.path.join(folder, "replan-tiny.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(raw, f)
    return out


def shifted(rates: dict[str, float]) -> dict[str, float]:
    """The rates with the most and the least popular model swapped."""
    top, low = max(rates, key=rates.get), min(rates, key=rates.get)
    return {**rates, top: rates[low], low: rates[top]}


def schedule(rates: dict[str, float], total: float, duration: float, rng) -> list[tuple[float, str]]:
    """(arrival s, model): Poisson arrivals at `rates` (scaled to `total`) in [0, duration/2),
    then at the shifted rates in [duration/2, duration)."""
    out = []
    for phase, r in enumerate((rates, shifted(rates))):
        scale = total / sum(r.values())
        for model, rate in r.items():
            if rate <= 0:
                continue
            times = arrivals(rng, rate * scale, int(rate * scale * duration) + 20, "poisson", 1.0)
            out += [(phase * duration / 2 + t, model) for t in times if t < duration / 2]
    return sorted(out)


def placement_actions(url: str) -> int:
    """Sum of /metrics' paraflex:placement_actions_total (every op and outcome)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("paraflex:placement_actions_total")))


def p99_ms(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, 99)) if xs else float("nan")


def run_arm(args, config_path: str, live: bool, slos: dict[str, tuple[float, float]], rates: dict[str, float]) -> dict:
    extra = ("--replan-interval", str(args.replan_interval)) if live else ()
    server = ServeProcess(config_path, threads=args.threads, who="replan_serve", extra_args=extra)
    try:
        rng = np.random.default_rng(args.seed)
        times = schedule(rates, args.rate, args.duration, rng)
        pools = {m: prompts_for(server.url, m, 16, args.input_len, rng) for m in rates}
        plan = [(t, m, pools[m][i % 16]) for i, (t, m) in enumerate(times)]
        results, wall = asyncio.run(open_loop(server.url, plan, args.output_len, args.request_timeout))
        actions = placement_actions(server.url)
    finally:
        server.stop()
    return summarize_arm(results, [t for t, _ in times], args.duration, wall, slos, actions)


def summarize_arm(results: list[Result], at: list[float], duration: float, wall: float,
                  slos: dict[str, tuple[float, float]], actions: int) -> dict:
    ok = [r for r in results if r.done and not r.refused]
    good = [r for r in ok if r.ttft * 1000 <= slos[r.model][0] and r.tpot * 1000 <= slos[r.model][1]]
    before = [r.ttft for r, t in zip(results, at) if r.done and not r.refused and t < duration / 2]
    after = [r.ttft for r, t in zip(results, at) if r.done and not r.refused and t >= duration / 2]
    return {"requests": len(results), "completed": len(ok), "refused": sum(r.refused for r in results),
            "lost": sum(r.lost for r in results), "slo_attainment": len(good) / max(1, len(results)),
            "goodput": len(good) / wall, "wall_s": wall, "p99_ttft_before_ms": p99_ms(before),
            "p99_ttft_after_ms": p99_ms(after), "placement_actions": actions}


def print_table(args, arms: dict[str, dict]) -> None:
    print(f"\npopularity shift at {args.duration / 2:g} s of {args.duration:g} s, {args.rate:g} req/s, "
          f"input {args.input_len} / output {args.output_len} tokens, load average {os.getloadavg()[0]:.1f}")
    print(f"{'arm':8s} {'done/sent':>10s} {'lost':>5s} {'refused':>8s} {'SLO att.':>9s} {'goodput':>8s} "
          f"{'P99 TTFT before':>16s} {'P99 TTFT after':>15s} {'actions':>8s}")
    for name, s in arms.items():
        print(f"{name:8s} {s['completed']:>4d}/{s['requests']:<5d} {s['lost']:>5d} {s['refused']:>8d} "
              f"{s['slo_attainment']:>8.1%} {s['goodput']:>6.2f}/s {s['p99_ttft_before_ms']:>13.0f} ms "
              f"{s['p99_ttft_after_ms']:>12.0f} ms {s['placement_actions']:>8d}")


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = tiny_config(args.config, folder) if args.tiny else args.config
        config = load_config(path)
        rates = {m.name: m.rate for m in config.models}
        slos = {m.name: (m.slo_ttft_ms or args.slo_ttft_ms, m.slo_tbt_ms or args.slo_tpot_ms) for m in config.models}
        print(f"load average at start {os.getloadavg()[0]:.1f}; rates before {rates}, after {shifted(rates)}")
        arms = {name: run_arm(args, path, name == "live", slos, rates) for name in ("static", "live")}
    print_table(args, arms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "arms": arms}, f, indent=2)
    return 1 if any(s["lost"] for s in arms.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
