"""Reproduce the paper's §8.2 base case in the simulator: all five systems over a rate sweep.

Prints, per system, the peak throughput (the highest swept rate whose P99 E2E latency stays
under --p99-bound seconds, default 60 s: beyond it queues grow without bound in the paper's
Fig. 8 too) and the median / P99 E2E latency at a common rate, each with its ratio against
paraflex; writes the sweep (CSV, JSON, Fig. 8/9-style PNGs) under --out.

    python bench/reproduce_paper.py [--rates 2,4,8,16] [--num-requests 300 | --duration 30]
        [--trace ../shared/data/traces/splitwise_conv.csv] [--ablations] [--jobs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys

from paraflex.config import load_config
from paraflex.simulator.runner import SimSettings
from paraflex.simulator.sweep import run_sweep

SYSTEMS = ["paraflex", "ray-serve", "sarathi", "alpaserve", "vllm-tp"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "paper-base.yaml"))
    ap.add_argument("--rates", default="2,4,8,16")
    ap.add_argument("--num-requests", type=int, default=300, help="expected requests per point (arrival window = N / rate)")
    ap.add_argument("--duration", type=float, help="arrival window in seconds instead (longer windows measure capacity, not drain)")
    ap.add_argument("--trace", help="replay this trace per model (the paper's method), e.g. ../shared/data/traces/splitwise_conv.csv")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ablations", action="store_true", help="also run §8.5's paraflex ablations (Fig. 17/18)")
    ap.add_argument("--p99-bound", type=float, default=60.0)
    ap.add_argument("--common-rate", type=float, help="rate for the latency comparison (default: the second swept rate)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/reproduce_paper")
    args = ap.parse_args()
    config = load_config(args.config)
    if args.duration:
        config.workload = dataclasses.replace(config.workload, duration_s=args.duration, num_requests=None)
    else:
        config.workload = dataclasses.replace(config.workload, duration_s=None, num_requests=args.num_requests)
    if args.trace:
        config.workload = dataclasses.replace(config.workload, arrival="trace", trace=os.path.abspath(args.trace))
    rates = [float(x) for x in args.rates.split(",")]
    systems = [s.strip() for s in args.systems.split(",")]
    if args.ablations:
        systems += ["paraflex+no-sharding", "paraflex+random-placement", "paraflex+prefill-first"]
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"config {args.config}: {config.cluster.num_engines} engines x TP{config.cluster.tp} {config.cluster.device}, "
          f"workload {config.workload.arrival} cv={config.workload.cv} zipf={config.workload.zipf_alpha}, "
          f"trace={config.workload.trace}, window " + (f"{args.duration:g} s" if args.duration else f"{args.num_requests} requests")
          + f" per point, rates {rates}")
    results = run_sweep(config, systems, rates, SimSettings(seed=args.seed), args.out, jobs=args.jobs)
    by = {(r["system"], r["rate"]): r for r in results}
    common = args.common_rate or rates[min(1, len(rates) - 1)]
    peak = {}
    for s in systems:
        ok = [r for r in rates if by[(s, r)]["e2e_p99_s"] is not None and by[(s, r)]["e2e_p99_s"] <= args.p99_bound]
        peak[s] = max((by[(s, r)]["throughput_rps"] for r in ok), default=0.0)
    base = "paraflex" if "paraflex" in systems else systems[0]
    print(f"\npeak throughput = highest achieved req/s among rates with P99 E2E <= {args.p99_bound:g} s; latency at {common:g} req/s")
    print(f"{'system':<26} {'peak req/s':>10} {'x paraflex':>10} {'median s':>9} {'x pf':>6} {'P99 s':>8} {'x pf':>6} {'SLO att':>8} {'GPU act':>8}")
    b = by[(base, common)]
    for s in systems:
        r = by[(s, common)]
        ratio = lambda a, c: (a / c) if c else float("nan")
        print(f"{s:<26} {peak[s]:>10.2f} {ratio(peak[s], peak[base]):>10.2f} {r['e2e_median_s']:>9.3f} "
              f"{ratio(r['e2e_median_s'], b['e2e_median_s']):>6.2f} {r['e2e_p99_s']:>8.2f} {ratio(r['e2e_p99_s'], b['e2e_p99_s']):>6.2f} "
              f"{r['slo_attainment']:>8.3f} {100 * r['active_gpu_share_mean']:>7.1f}%")
    print(f"\nresults: {args.out}/ (sweep.csv, sweep.json, latency_vs_throughput.png, per_model.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
