"""Placement x engine policy on the §8.2 base case: which of the two makes the difference?

ParaFlex and multiplexed Sarathi differ in two things at once: the layout (ParaFlex's
time-balanced sharding, replication and placement vs every model PP = 8 on every engine) and
the engine-local policy (full-batch-first with unbatched prefills vs Sarathi's chunked prefill
mixed with the ready decodes). This bench crosses them, 2 x 2, on the same requests:

| layout \\ policy | full-batch-first | sarathi (512-token chunks) |
|-----------------|------------------|----------------------------|
| paraflex        | `paraflex`       | paraflex layout + sarathi  |
| shared PP = 8   | `paraflex --no-sharding` | `sarathi`          |

and prints, per cell, the mean [min-max] over seeds of achieved throughput, median and P99
E2E, P99 TBT, decode batch size and engine-milliseconds per output token (busy engine time /
tokens generated: the work the cluster spends per token), each with its ratio to `paraflex`.

    python bench/reproduce_factors.py --rates 48,64 --seeds 3 --duration 90 \\
        --trace ../shared/data/traces/splitwise_conv.csv [--jobs 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from paraflex.config.schema import load_config
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.sweep import point_seed
from paraflex.simulator.systems.layouts import SARATHI_CHUNK_TOKENS, build_system
from paraflex.cpu_info import machine_line

# (label, system, no_sharding, policy override)
CELLS = [
    ("paraflex (placement + full-batch-first)", "paraflex", False, None),
    ("paraflex placement + sarathi policy", "paraflex", False, "sarathi"),
    ("shared PP=8 + full-batch-first", "paraflex", True, None),
    ("sarathi (shared PP=8 + sarathi policy)", "sarathi", False, None),
]
METRICS = ("throughput_rps", "e2e_median_s", "e2e_p99_s", "tbt_p99_s", "decode_batch_size_mean", "engine_ms_per_token")


def layout_of(config, system: str, no_sharding: bool, policy: str | None):
    layout = build_system(config, SimSettings(system=system, no_sharding=no_sharding))
    if policy == "sarathi":
        layout.policy = "sarathi"
        layout.prefill_token_budget = SARATHI_CHUNK_TOKENS
    return layout


def _point(args) -> dict:
    config, cell, rate, seed = args
    label, system, no_sharding, policy = cell
    res = simulate(config, SimSettings(system=system, rate=rate, seed=seed), layout=layout_of(config, system, no_sharding, policy))
    s = res.summary
    busy = sum(sum(b[1::2]) - sum(b[0::2]) for b in res.metrics.busy)
    out = {k: s[k] for k in METRICS if k in s}
    out.update(cell=label, rate=rate, seed=seed, engine_ms_per_token=1e3 * busy / max(1, s["output_tokens"]), wall_s=s["wall_s"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "paper-base.yaml"))
    ap.add_argument("--rates", default="48,64")
    ap.add_argument("--seeds", type=int, default=3, help="replicates per rate (seeds as in bench/reproduce_paper.py)")
    ap.add_argument("--duration", type=float, default=90.0, help="arrival window, seconds")
    ap.add_argument("--trace", help="replay this trace per model, e.g. ../shared/data/traces/splitwise_conv.csv")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/reproduce_factors")
    args = ap.parse_args()
    config = load_config(args.config)
    config.workload = dataclasses.replace(config.workload, duration_s=args.duration, num_requests=None)
    if args.trace:
        config.workload = dataclasses.replace(config.workload, arrival="trace", trace=os.path.abspath(args.trace))
    rates = [float(x) for x in args.rates.split(",")]
    print(f"machine: {machine_line()}; "
          f"window {args.duration:g} s, rates {rates}, {args.seeds} seeds, trace={config.workload.trace}")
    tasks = [(config, cell, rate, point_seed(args.seed, i, k)) for cell in CELLS for i, rate in enumerate(rates) for k in range(args.seeds)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = []
        for r in pool.map(_point, tasks):
            results.append(r)
            print(f"  {r['cell']:<42} {r['rate']:>5g} req/s seed {r['seed']:>5}: {r['throughput_rps']:.1f} req/s, "
                  f"median {r['e2e_median_s']:.1f} s, {r['wall_s']:.0f} s wall", file=sys.stderr)
    wall = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "factors.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    lines = []
    for rate in rates:
        lines += ["", f"offered {rate:g} req/s; mean [min-max] over {args.seeds} seeds; (x) = ratio of means to paraflex", "",
                  "| layout + policy | achieved req/s | median E2E s | P99 E2E s | P99 TBT ms | decode batch | engine-ms / output token |",
                  "|---|---|---|---|---|---|---|"]
        base = {k: _mean([r[k] for r in results if r["cell"] == CELLS[0][0] and r["rate"] == rate]) for k in METRICS}
        for cell in CELLS:
            rs = [r for r in results if r["cell"] == cell[0] and r["rate"] == rate]
            cells = []
            for k in METRICS:
                vals = [r[k] * (1e3 if k == "tbt_p99_s" else 1) for r in rs]
                m = _mean(vals)
                fmt = ".2f" if k == "engine_ms_per_token" else ".1f"
                ratio = m / (base[k] * (1e3 if k == "tbt_p99_s" else 1)) if base[k] else float("nan")
                cells.append(f"{m:{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}] ({ratio:.2f})")
            lines.append(f"| {cell[0]} | " + " | ".join(cells) + " |")
    lines += ["", f"{len(results)} points in {wall:.0f} s wall with {args.jobs} jobs"]
    print("\n".join(lines))
    with open(os.path.join(args.out, "factors.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    sys.exit(main())
