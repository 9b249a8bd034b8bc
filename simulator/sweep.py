"""Rates x systems: many simulations across processes, then Fig. 8/9-style plots.

`run_sweep(config, systems, rates, base_settings, out_dir, jobs)` plans each system once (a
system may carry §8.5 ablations: `paraflex+no-sharding`, `paraflex+random-placement`,
`paraflex+prefill-first`),
simulates every (system, rate, replicate) point in a process pool, prints a progress bar (progress.py) on
stderr, appends each finished point to points.jsonl, and writes sweep.csv, sweep.json and two PNGs: latency_vs_throughput.png (median and
P99 E2E latency versus achieved throughput, one line per system: Fig. 8) and per_model.png
(the same per model: Fig. 9); with several replicates the curves show the mean over seeds
and bars from the lowest to the highest seed. Used by `paraflex simulate --sweep` and
bench/reproduce_paper.py.

Seeds: replicate k of the rate at index i runs with seed `base + 1000 k + i` (`point_seed`),
so every system sees the same requests at a given (rate, replicate), different rates see
different draws (as §8.1 varies seeds across rates), and replicates are independent draws.
`aggregate` reduces the replicates of each (system, rate) to mean, min and max.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed

from paraflex.errors import UserError
from paraflex.simulator.metrics.output import pyplot, write_json
from paraflex.simulator.progress import Progress
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system

COLUMNS = ("system", "rate", "seed", "replicate", "finished", "throughput_rps", "throughput_tok_s", "e2e_median_s", "e2e_p99_s",
           "ttft_median_s", "ttft_p99_s", "tbt_median_s", "tbt_p99_s", "slo_attainment", "goodput_rps",
           "active_gpu_share_mean", "decode_batch_size_mean", "swap_outs", "wall_s")


SEED_STRIDE = 1000  # seed distance between replicates (rate indices stay below it)
AGGREGATED = ("throughput_rps", "e2e_median_s", "e2e_p99_s", "ttft_median_s", "tbt_median_s", "slo_attainment",
              "goodput_rps", "active_gpu_share_mean", "decode_batch_size_mean")

ABLATIONS = {"no-sharding": "no_sharding", "random-placement": "random_placement", "prefill-first": "prefill_first",
             "pipeline-first": "pipeline_first",
             "unbounded-decode-batches": "unbounded_decode_batches", "paper-replication": "paper_replication",
             "work-shares": "work_shares", "memory-only-placement": "memory_only_placement",
             "no-head-start": "no_head_start",
             "one-prompt-prefills": "one_prompt_prefills"}


def parse_system(spec: str, base: SimSettings) -> SimSettings:
    """`name[+ablation...]`, e.g. `paraflex+prefill-first`: a system with §8.5 ablations."""
    name, *flags = spec.split("+")
    changes = {"system": name}
    for f in flags:
        if f not in ABLATIONS:
            raise UserError(f"system {spec!r}: unknown ablation {f!r}; choose from {', '.join(ABLATIONS)}")
        changes[ABLATIONS[f]] = True
    return dataclasses.replace(base, **changes)


def _point(args):
    config, layout, settings, label, replicate = args
    summary = simulate(config, settings, layout=layout).summary
    summary["system"] = label
    summary["replicate"] = replicate
    return summary


def point_seed(base_seed: int, rate_index: int, replicate: int) -> int:
    """The seed of one sweep point (module docstring)."""
    if not 0 <= rate_index < SEED_STRIDE:
        raise UserError(f"--rates: at most {SEED_STRIDE} rates per sweep (got index {rate_index})")
    return base_seed + SEED_STRIDE * replicate + rate_index


def run_sweep(config, systems: list[str], rates: list[float], base: SimSettings, out_dir: str | None,
              jobs: int = 1, quiet: bool = False, replicates: int = 1) -> list[dict]:
    """Summaries of every (system, rate, replicate) point, in that nesting order; each carries
    `system`, `rate`, `seed` and `replicate`."""
    if replicates < 1:
        raise UserError(f"--seeds must be >= 1 replicate per rate, got {replicates}")
    specs = {s: parse_system(s, base) for s in systems}
    layouts = {s: build_system(config, specs[s]) for s in systems}
    tasks = []
    for system in systems:
        for i, rate in enumerate(rates):
            for k in range(replicates):
                st = dataclasses.replace(specs[system], rate=rate, seed=point_seed(base.seed, i, k))
                tasks.append((config, layouts[system], st, system, k))
    # Highest rates first: they run longest, so the pool does not end on one slow point.
    order = sorted(range(len(tasks)), key=lambda j: -tasks[j][2].rate)
    progress = None if quiet else Progress(len(tasks), "simulate sweep")
    done: dict[int, dict] = {}
    log = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        log = open(os.path.join(out_dir, "points.jsonl"), "w", encoding="utf-8")

    def record(j: int, summary: dict) -> None:
        done[j] = summary
        if log:  # finished points survive an interrupted sweep
            log.write(json.dumps(summary) + "\n")
            log.flush()
        if progress:
            progress.step(f"{summary['system']} @ {summary['rate']:g} req/s seed {summary['seed']}")

    try:
        if jobs > 1:
            with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
                futures = {pool.submit(_point, tasks[j]): j for j in order}
                for fut in as_completed(futures):
                    record(futures[fut], fut.result())
        else:
            for j in order:
                record(j, _point(tasks[j]))
    finally:
        if log:
            log.close()
    results = [done[j] for j in range(len(tasks))]
    if out_dir:
        write_sweep(out_dir, results, {s: layouts[s].describe() for s in systems}, config, base)
    return results


def write_sweep(out_dir: str, results: list[dict], layouts: dict, config, base: SimSettings) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    p_csv = os.path.join(out_dir, "sweep.csv")
    with open(p_csv, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in results:
            w.writerow([r.get(c) for c in COLUMNS])
    p_json = os.path.join(out_dir, "sweep.json")
    write_json(p_json, {"results": results, "aggregate": aggregate(results)})
    p_cfg = os.path.join(out_dir, "config.json")
    write_json(p_cfg, {"config": config.to_dict(), "simulation": dataclasses.asdict(base), "layouts": layouts})
    return [p_csv, p_json, p_cfg, plot_latency_throughput(out_dir, results), plot_per_model(out_dir, results)]


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(results: list[dict], keys=AGGREGATED) -> list[dict]:
    """One row per (system, rate): `{key: {"mean", "min", "max", "n"}}` over the replicates
    (a metric that is None in some replicate, e.g. no finished request, counts only where
    set), plus `per_model` with the same reduction of each model's throughput, median and P99."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["system"], r["rate"]), []).append(r)
    rows = []
    for (system, rate), rs in groups.items():
        row = {"system": system, "rate": rate, "seeds": [r["seed"] for r in rs]}
        for k in keys:
            vals = [r[k] for r in rs if r.get(k) is not None]
            row[k] = _stats(vals) if vals else None
        models = rs[0].get("per_model", {})
        row["per_model"] = {m: {k: _stats([r["per_model"][m][k] for r in rs if r["per_model"][m].get(k) is not None] or [float("nan")])
                                for k in ("throughput_rps", "e2e_median_s", "e2e_p99_s")} for m in models}
        rows.append(row)
    return rows


def _by_system(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["system"], []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["rate"])
    return out


def _curve(ax, points: list[tuple[dict, dict]], label: str) -> None:
    """Mean latency versus mean throughput over seeds; bars span the seeds' min..max."""
    x = [p[0]["mean"] for p in points]
    y = [p[1]["mean"] for p in points]
    yerr = [[p[1]["mean"] - p[1]["min"] for p in points], [p[1]["max"] - p[1]["mean"] for p in points]]
    xerr = [[p[0]["mean"] - p[0]["min"] for p in points], [p[0]["max"] - p[0]["mean"] for p in points]]
    ax.errorbar(x, y, xerr=xerr, yerr=yerr, marker="o", ms=3, capsize=2, elinewidth=0.8, label=label)


def plot_latency_throughput(out_dir: str, results: list[dict]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, rows in _by_system(aggregate(results)).items():
        rows = [r for r in rows if r["e2e_median_s"] is not None]
        for ax, key in zip(axes, ("e2e_median_s", "e2e_p99_s")):
            _curve(ax, [(r["throughput_rps"], r[key]) for r in rows], system)
    for ax, title in zip(axes, ("median E2E latency", "P99 E2E latency")):
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("latency (s)")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "latency_vs_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_per_model(out_dir: str, results: list[dict]) -> str:
    plt = pyplot()
    models = list(results[0]["per_model"]) if results else []
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(3.2 * max(1, len(models)), 6), squeeze=False)
    for system, rows in _by_system(aggregate(results)).items():
        for j, m in enumerate(models):
            pm = [r["per_model"][m] for r in rows]
            _curve(axes[0][j], [(p["throughput_rps"], p["e2e_median_s"]) for p in pm], system)
            _curve(axes[1][j], [(p["throughput_rps"], p["e2e_p99_s"]) for p in pm], system)
    for j, m in enumerate(models):
        axes[0][j].set_title(m, fontsize=9)
        for i, what in enumerate(("median", "P99")):
            ax = axes[i][j]
            ax.set_yscale("log")
            ax.set_xlabel("model throughput (req/s)")
            ax.set_ylabel(f"{what} E2E (s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "per_model.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
