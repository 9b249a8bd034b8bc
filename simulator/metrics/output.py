"""Write one simulation's results next to the settings that produced them.

`write_run(out_dir, result)` (called by `paraflex simulate` and the sweep workers) writes:
requests.csv (one row per request, metrics.py definitions), summary.json (aggregate and
per-model metrics, workload info), config.json (the resolved config, the simulation settings
and the system's layout: enough to run it again), placement.json (the placement simulated)
and PNGs: active-GPU share over time and its CDF (Fig. 16), the decode batch-size
histogram and, for the seed systems, the CDF of model switch latency. Sweep plots (Fig. 8/9 style) live in sweep.py.
"""

from __future__ import annotations

import csv
import json
import os

import numpy as np


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: str, data) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=False, default=_default)
        fh.write("\n")


def _default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_run(out_dir: str, result) -> list[str]:
    """Write every output of `result` (a runner.SimResult) under out_dir; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    p = os.path.join(out_dir, "requests.csv")
    with open(p, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        for row in result.metrics.request_rows():
            w.writerow(csv_cells(row))
    paths.append(p)
    for name, data in (("summary.json", result.summary), ("config.json", result.settings)):
        p = os.path.join(out_dir, name)
        write_json(p, data)
        paths.append(p)
    p = os.path.join(out_dir, "placement.json")
    result.placement.save(p)
    paths.append(p)
    paths += plot_run(out_dir, result)
    return paths


def csv_cells(row) -> list:
    """A requests.csv row as written: floats with microsecond precision."""
    return [f"{v:.6f}" if isinstance(v, float) else v for v in row]


def _save(plt, fig, out_dir: str, name: str) -> str:
    """Lay out, write and close one figure; its path."""
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(out_dir: str, result) -> list[str]:
    plt = pyplot()
    paths = []
    t, share = result.metrics.active_share()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(t, share * 100, lw=1)
    a.set_xlabel("simulated time (s)")
    a.set_ylabel("active GPUs (%)")
    a.set_ylim(0, 105)
    a.set_title(f"{result.system}: active GPUs over time")
    xs = np.sort(share * 100)
    b.plot(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), drawstyle="steps-post")
    b.set_xlabel("active GPUs (%)")
    b.set_ylabel("CDF")
    b.set_xlim(0, 105)
    b.set_title("CDF of active GPU share (Fig. 16)")
    paths.append(_save(plt, fig, out_dir, "active_gpus.png"))
    sizes = np.frombuffer(result.metrics.decode_batch_sizes, dtype=np.int32) if len(result.metrics.decode_batch_sizes) else np.zeros(0)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if len(sizes):
        ax.hist(sizes, bins=range(1, int(sizes.max()) + 2), align="left")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("stage executions")
    ax.set_title(f"{result.system}: decode batch sizes")
    paths.append(_save(plt, fig, out_dir, "batch_sizes.png"))
    if len(result.metrics.switch_latencies):
        lat = np.sort(np.frombuffer(result.metrics.switch_latencies, dtype=float))
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), drawstyle="steps-post")
        ax.set_xlabel("switch / activation latency (s)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{result.system}: model switch latency (Aegaeon Fig. 15)")
        paths.append(_save(plt, fig, out_dir, "switch_latency.png"))
    return paths
