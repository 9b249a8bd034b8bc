"""Reproduce the paper's §8.2 base case in the simulator: the paper's five systems and the seed
systems (aegaeon, prism, muxserve) over a rate sweep, several seeds per rate.

Prints, per system, the peak throughput (per seed: the highest achieved throughput among the
swept rates whose P99 E2E latency stays under --p99-bound seconds, default 60 s: beyond it
queues grow without bound in the paper's Fig. 8 too; then mean and min..max over seeds), the
highest offered rate it sustains under that bound, and the median / P99 E2E latency at a
common rate (mean and min..max over seeds), each with its ratio against paraflex; also the
per-model medians at the common rate (Fig. 9) and the sweep's wall time. Writes the sweep
(points.jsonl as points finish, sweep.csv, sweep.json with the per-seed and aggregated
results, Fig. 8/9-style PNGs) and results.md (the same tables in Markdown) under --out.

    python bench/reproduce_paper.py [--rates 16,32,64,96] [--seeds 3] [--duration 60]
        [--trace ../shared/data/traces/splitwise_conv.csv] [--ablations] [--jobs 2]
        [--popularity balanced,1.01,2.1]

`--popularity` runs the whole sweep once per model popularity (`balanced`: every model at the
same rate; a number: Zipf with that exponent over the config's list) into --out/<popularity>/
and ends with one summary table: per popularity each system's peak, paraflex's peak against
the best other system, and the no-collapse check (paraflex's achieved throughput at the swept
rates nearest 1.5x and 2x the offered rate of its peak, as a share of the peak). `--ablations`
adds the paper's rules (`paraflex+unbounded-decode-batches+paper-replication`) and the §8.5
ablations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

from paraflex.config.schema import load_config
from paraflex.simulator.runner import SimSettings
from paraflex.simulator.sweep import run_sweep

SYSTEMS = ["paraflex", "ray-serve", "sarathi", "alpaserve", "vllm-tp", "aegaeon", "prism", "muxserve"]


def _rng(values: list[float], fmt: str = ".1f") -> str:
    """'mean [min-max]' (just the value for one seed); None values (no request of a model
    finished in a short window) are left out."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    m = sum(values) / len(values)
    if len(values) == 1:
        return f"{m:{fmt}}"
    return f"{m:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def peaks(results: list[dict], system: str, rates: list[float], bound: float) -> tuple[list[float], list[float]]:
    """Per replicate: (peak achieved throughput, highest sustained offered rate) under the P99 bound."""
    reps = sorted({r["replicate"] for r in results if r["system"] == system})
    peak, sustained = [], []
    for k in reps:
        ok = [r for r in results if r["system"] == system and r["replicate"] == k
              and r["e2e_p99_s"] is not None and r["e2e_p99_s"] <= bound]
        peak.append(max((r["throughput_rps"] for r in ok), default=0.0))
        sustained.append(max((r["rate"] for r in ok), default=0.0))
    return peak, sustained


def report(results: list[dict], systems: list[str], rates: list[float], common: float, bound: float) -> list[str]:
    """The result tables as Markdown lines."""
    at = {s: [r for r in results if r["system"] == s and r["rate"] == common] for s in systems}
    base = "paraflex" if "paraflex" in systems else systems[0]
    pk = {s: peaks(results, s, rates, bound) for s in systems}
    ratio = lambda a, b: f"{a / b:.2f}" if b else "—"
    lines = [f"peak = highest achieved req/s among rates with P99 E2E <= {bound:g} s, per seed; "
             f"values are mean [min-max] over seeds; latency at {common:g} req/s offered", "",
             "| system | peak req/s | × paraflex | sustained offered req/s | median E2E s | × paraflex | P99 E2E s | × paraflex "
             "| SLO attainment | active GPUs | decode batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    bmed = _mean([r["e2e_median_s"] for r in at[base]])
    bp99 = _mean([r["e2e_p99_s"] for r in at[base]])
    for s in systems:
        peak, sustained = pk[s]
        rs = at[s]
        if not rs:
            lines.append(f"| {s} | {_rng(peak)} | {ratio(_mean(peak), _mean(pk[base][0]))} | {_rng(sustained, '.0f')} | — | — | — | — | — | — | — |")
            continue
        med, p99 = [r["e2e_median_s"] for r in rs], [r["e2e_p99_s"] for r in rs]
        lines.append(f"| {s} | {_rng(peak)} | {ratio(_mean(peak), _mean(pk[base][0]))} | {_rng(sustained, '.0f')} "
                     f"| {_rng(med)} | {ratio(_mean(med), bmed)} | {_rng(p99)} | {ratio(_mean(p99), bp99)} "
                     f"| {_mean([r['slo_attainment'] for r in rs]):.3f} | {100 * _mean([r['active_gpu_share_mean'] for r in rs]):.0f}% "
                     f"| {_mean([r['decode_batch_size_mean'] for r in rs]):.1f} |")
    models = list(at[base][0]["per_model"]) if at[base] else []
    lines += ["", f"per-model median E2E s at {common:g} req/s (mean [min-max] over seeds)", "",
              "| system | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for s in systems:
        cells = [_rng([r["per_model"][m]["e2e_median_s"] for r in at[s]]) if at[s] else "—" for m in models]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "achieved req/s by offered rate (mean [min-max] over seeds; * = P99 over the bound in some seed)", "",
              "| system | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for s in systems:
        cells = []
        for rate in rates:
            rs = [r for r in results if r["system"] == s and r["rate"] == rate]
            if not rs:
                cells.append("—")
                continue
            star = "*" if any(r["e2e_p99_s"] is None or r["e2e_p99_s"] > bound for r in rs) else ""
            cells.append(_rng([r["throughput_rps"] for r in rs]) + star)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def report_only(args) -> int:
    """Tables from the points a previous run logged; rates and systems as found there."""
    path = os.path.join(args.out, "points.jsonl")
    if not os.path.isfile(path):
        print(f"--report-only: {path} not found; run the sweep with --out {args.out} first", file=sys.stderr)
        return 2
    with open(path, encoding="utf-8") as fh:
        results = [json.loads(line) for line in fh if line.strip()]
    systems = list(dict.fromkeys(r["system"] for r in results))
    rates = sorted({r["rate"] for r in results})
    common = args.common_rate or rates[min(1, len(rates) - 1)]
    complete = {(r["system"], r["rate"]) for r in results}
    missing = [f"{s}@{r:g}" for s in systems for r in rates if (s, r) not in complete]
    lines = report(results, systems, rates, common, args.p99_bound)
    lines += ["", f"{len(results)} points from {path}" + (f"; missing: {', '.join(missing)}" if missing else "")]
    print("\n".join(lines))
    return 0


def with_popularity(config, pop: str):
    """A copy of `config` whose models get popularity `pop` ('balanced' or a Zipf exponent)."""
    config = dataclasses.replace(config, models=[dataclasses.replace(m) for m in config.models])
    if pop == "balanced":
        config.workload = dataclasses.replace(config.workload, zipf_alpha=None)
        for m in config.models:
            m.rate = 1.0
    else:
        config.workload = dataclasses.replace(config.workload, zipf_alpha=float(pop))
        config.workload.write_zipf_rates(config.models)
    return config


def collapse_check(results: list[dict], system: str, rates: list[float], bound: float) -> str:
    """Achieved throughput at the swept rates nearest 1.5x and 2x the offered rate of `system`'s
    peak, as a share of the peak (mean over seeds)."""
    peak, _ = peaks(results, system, rates, bound)
    if not peak or not max(peak):
        return "—"
    at_peak = [r["rate"] for r in results if r["system"] == system and r["throughput_rps"] in peak]
    sat = min(at_peak) if at_peak else rates[0]
    cells = []
    for k in (1.5, 2.0):
        above = [r for r in rates if r >= k * sat * 0.95]
        if not above:
            cells.append(f"{k:g}x: not swept")
            continue
        rate = above[0]
        got = _mean([r["throughput_rps"] for r in results if r["system"] == system and r["rate"] == rate])
        cells.append(f"{k:g}x ({rate:g}): {got / _mean(peak):.2f}")
    return f"peak at {sat:g}; " + ", ".join(cells)


def by_popularity(args, config, systems: list[str], rates: list[float], common: float) -> int:
    summary = ["| popularity | " + " | ".join(systems) + " | paraflex / best other | no collapse (achieved / peak) |",
               "|---|" + "---|" * len(systems) + "---|---|"]
    t0 = time.perf_counter()
    for pop in args.popularity.split(","):
        pop = pop.strip()
        cfg = with_popularity(config, pop)
        out = os.path.join(args.out, pop)
        print(f"\n### popularity {pop}")
        results = run_sweep(cfg, systems, rates, SimSettings(seed=args.seed), out, jobs=args.jobs, replicates=args.seeds)
        lines = report(results, systems, rates, common, args.p99_bound)
        print("\n".join(lines))
        with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        pk = {s: _mean(peaks(results, s, rates, args.p99_bound)[0]) for s in systems}
        others = [pk[s] for s in systems if not s.startswith("paraflex")]
        best = max(others) if others else float("nan")
        ratio = f"{pk['paraflex'] / best:.2f}" if "paraflex" in pk and others and best else "—"
        summary.append(f"| {pop} | " + " | ".join(f"{pk[s]:.1f}" for s in systems) + f" | {ratio} | "
                       f"{collapse_check(results, 'paraflex', rates, args.p99_bound) if 'paraflex' in pk else '—'} |")
    print(f"\n### summary: peak req/s (P99 E2E <= {args.p99_bound:g} s), mean over {args.seeds} seed(s); "
          f"{time.perf_counter() - t0:.0f} s wall\n")
    print("\n".join(summary))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(summary) + "\n")
    return 0


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
    ap.add_argument("--seeds", type=int, default=1, help="replicates per rate, each an independent draw (default 1)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="base seed (replicate k at rate index i uses seed + 1000 k + i)")
    ap.add_argument("--out", default="bench-results/reproduce_paper")
    ap.add_argument("--popularity", help="comma-separated: balanced and/or Zipf exponents, e.g. balanced,1.01,2.1 "
                    "(one sweep each, under --out/<popularity>/, then a summary table)")
    ap.add_argument("--report-only", action="store_true",
                    help="simulate nothing: rebuild the tables from --out/points.jsonl (e.g. of an interrupted sweep)")
    args = ap.parse_args()
    if args.report_only:
        return report_only(args)
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
        systems += ["paraflex+unbounded-decode-batches+paper-replication", "paraflex+no-sharding",
                    "paraflex+random-placement", "paraflex+prefill-first"]
    common = args.common_rate or rates[min(1, len(rates) - 1)]
    if common not in rates:
        print(f"--common-rate {common:g} is not among --rates {args.rates}; add it or pick a swept rate", file=sys.stderr)
        return 2
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"config {args.config}: {config.cluster.num_engines} engines x TP{config.cluster.tp} {config.cluster.device}, "
          f"workload {config.workload.arrival} cv={config.workload.cv} zipf={config.workload.zipf_alpha}, "
          f"trace={config.workload.trace}, window " + (f"{args.duration:g} s" if args.duration else f"{args.num_requests} requests")
          + f" per point, rates {rates}, {args.seeds} seed(s) per rate, {args.jobs} jobs")
    if args.popularity:
        return by_popularity(args, config, systems, rates, common)
    t0 = time.perf_counter()
    results = run_sweep(config, systems, rates, SimSettings(seed=args.seed), args.out, jobs=args.jobs, replicates=args.seeds)
    wall = time.perf_counter() - t0
    lines = report(results, systems, rates, common, args.p99_bound)
    simulated = sum(r["requests"] for r in results)
    lines += ["", f"{len(results)} points, {simulated:,} simulated requests, {wall:.0f} s wall with {args.jobs} jobs "
              f"({sum(r['wall_s'] for r in results):.0f} s of point time) on {os.cpu_count()} cores"]
    print()
    print("\n".join(lines))
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"\nresults: {args.out}/ (results.md, sweep.csv, sweep.json, points.jsonl, latency_vs_throughput.png, per_model.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
