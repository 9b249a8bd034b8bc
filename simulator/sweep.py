"""Rates x systems: many simulations across processes, then Fig. 8/9-style plots.

`run_sweep(config, systems, rates, base_settings, out_dir, jobs)` plans each system once (a
system may carry §8.5 ablations: `paraflex+no-sharding`, `paraflex+random-placement`,
`paraflex+prefill-first`),
simulates every (system, rate) point in a process pool (each point's seed is the base seed +
the rate's index, so every system sees the same requests at a given rate, and different rates
see different draws, as §8.1 varies seeds across rates), prints a progress bar on stderr,
and writes sweep.csv, sweep.json and two PNGs: latency_vs_throughput.png (median and P99
E2E latency versus achieved throughput, one line per system: Fig. 8) and per_model.png
(the same per model: Fig. 9). Used by `paraflex simulate --sweep` and bench/reproduce_paper.py.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from paraflex.errors import UserError
from paraflex.simulator.output import pyplot, write_json
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems import build_system

COLUMNS = ("system", "rate", "seed", "finished", "throughput_rps", "throughput_tok_s", "e2e_median_s", "e2e_p99_s",
           "ttft_median_s", "ttft_p99_s", "tbt_median_s", "tbt_p99_s", "slo_attainment", "goodput_rps",
           "active_gpu_share_mean", "decode_batch_size_mean", "swap_outs", "wall_s")


ABLATIONS = {"no-sharding": "no_sharding", "random-placement": "random_placement", "prefill-first": "prefill_first"}


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
    config, layout, settings, label = args
    summary = simulate(config, settings, layout=layout).summary
    summary["system"] = label
    return summary


class Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def step(self, note: str = "") -> None:
        self.done += 1
        width = 30
        fill = int(width * self.done / self.total)
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                          f"{el:5.0f}s elapsed, ~{eta:4.0f}s left {note[:40]:<40}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_sweep(config, systems: list[str], rates: list[float], base: SimSettings, out_dir: str | None,
              jobs: int = 1, quiet: bool = False) -> list[dict]:
    specs = {s: parse_system(s, base) for s in systems}
    layouts = {s: build_system(config, specs[s]) for s in systems}
    tasks = []
    for system in systems:
        for i, rate in enumerate(rates):
            st = dataclasses.replace(specs[system], rate=rate, seed=base.seed + i)
            tasks.append((config, layouts[system], st, system))
    progress = None if quiet else Progress(len(tasks), "simulate sweep")
    results: list[dict] = []
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for summary in pool.map(_point, tasks):
                results.append(summary)
                if progress:
                    progress.step(f"{summary['system']} @ {summary['rate']:g} req/s")
    else:
        for task in tasks:
            results.append(_point(task))
            if progress:
                progress.step(f"{results[-1]['system']} @ {results[-1]['rate']:g} req/s")
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
    write_json(p_json, {"results": results})
    p_cfg = os.path.join(out_dir, "config.json")
    write_json(p_cfg, {"config": config.to_dict(), "simulation": dataclasses.asdict(base), "layouts": layouts})
    return [p_csv, p_json, p_cfg, plot_latency_throughput(out_dir, results), plot_per_model(out_dir, results)]


def _by_system(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["system"], []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["rate"])
    return out


def plot_latency_throughput(out_dir: str, results: list[dict]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, rows in _by_system(results).items():
        x = [r["throughput_rps"] for r in rows]
        for ax, key in zip(axes, ("e2e_median_s", "e2e_p99_s")):
            ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label=system)
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
    for system, rows in _by_system(results).items():
        for j, m in enumerate(models):
            pm = [r["per_model"][m] for r in rows]
            x = [p["throughput_rps"] for p in pm]
            axes[0][j].plot(x, [p["e2e_median_s"] for p in pm], marker="o", ms=3, label=system)
            axes[1][j].plot(x, [p["e2e_p99_s"] for p in pm], marker="o", ms=3, label=system)
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
