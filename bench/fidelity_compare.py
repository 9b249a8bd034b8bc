"""Real vs simulated per-request records, compared: the report half of bench/sim_fidelity.py.

Place in the data flow: sim_fidelity.py hands this module, per load, the served run's rows
(`paraflex serve --request-log`, times shifted to the client's start) and the simulated run's
rows (`MetricsStore.request_rows`), both in REQUEST_COLUMNS. `compare` turns them into one row
per (load, model, metric) with the relative error; `print_table`, `write_csv` and `plot_cdfs`
report them. TBT here is each request's mean gap (the served log keeps the mean and max per
request, not every gap), for both sides alike.

bench/ is no package: sim_fidelity.py puts this folder on sys.path to import it.
"""

from __future__ import annotations

import csv

import numpy as np

METRICS = ("ttft_s", "mean_tbt_s", "e2e_s")
LABEL = {"ttft_s": "TTFT", "mean_tbt_s": "TBT", "e2e_s": "E2E"}
TARGET = {"median": 0.10, "p99": 0.20, "throughput": 0.05}  # the targets


def throughput(rows: list[dict]) -> float:
    """Finished requests / (last finish - first arrival), as MetricsStore.summary counts it."""
    if not rows:
        return float("nan")
    span = max(float(r["finish_s"]) for r in rows) - min(float(r["arrival_s"]) for r in rows)
    return len(rows) / span if span > 0 else float("nan")


def rel_err(sim: float, real: float) -> float:
    return (sim - real) / real if real and np.isfinite(real) and np.isfinite(sim) else float("nan")


def compare(load: str, real: list[dict], sim: list[dict]) -> list[dict]:
    """Rows (load, model, metric, stat, real, sim, rel_err) for every model and all models."""
    out = []
    models = sorted({r["model"] for r in real} | {r["model"] for r in sim})
    for model in models + ["all"]:
        pick = (lambda rows: rows) if model == "all" else (lambda rows: [r for r in rows if r["model"] == model])
        a, b = pick(real), pick(sim)
        for metric in METRICS:
            xa = np.array([float(r[metric]) for r in a]) if a else np.zeros(0)
            xb = np.array([float(r[metric]) for r in b]) if b else np.zeros(0)
            for stat, q in (("median", 50), ("p99", 99)):
                va = float(np.percentile(xa, q)) if len(xa) else float("nan")
                vb = float(np.percentile(xb, q)) if len(xb) else float("nan")
                out.append({"load": load, "model": model, "metric": LABEL[metric], "stat": stat,
                            "real": va, "sim": vb, "rel_err": rel_err(vb, va)})
        ta, tb = throughput(a), throughput(b)
        out.append({"load": load, "model": model, "metric": "throughput", "stat": "req/s", "real": ta, "sim": tb,
                    "rel_err": rel_err(tb, ta)})
    return out


def within_target(row: dict) -> bool:
    limit = TARGET["throughput"] if row["metric"] == "throughput" else TARGET[row["stat"]]
    return bool(np.isfinite(row["rel_err"]) and abs(row["rel_err"]) <= limit)


def print_table(rows: list[dict]) -> None:
    print(f"{'load':<8} {'model':<9} {'metric':<10} {'stat':<6} {'real':>10} {'sim':>10} {'error':>8}")
    for r in rows:
        unit = 1.0 if r["metric"] == "throughput" else 1000.0  # latencies in ms
        mark = "" if within_target(r) else "  miss"
        print(f"{r['load']:<8} {r['model']:<9} {r['metric']:<10} {r['stat']:<6} {r['real'] * unit:>10.2f} "
              f"{r['sim'] * unit:>10.2f} {100 * r['rel_err']:>7.1f}%{mark}")
    print("(latencies in ms, throughput in req/s; error = (sim - real) / real; 'miss': outside the target "
          "of 10% median, 20% P99, 5% throughput)")


def print_runs(per_run: list[list[dict]]) -> None:
    """All models, per load, metric and statistic: each run's error and in how many runs it is
    within the target."""
    keys = [(r["load"], r["metric"], r["stat"]) for r in per_run[0] if r["model"] == "all"]
    print(f"\nall models, {len(per_run)} runs: error per run (sim - real) / real, and runs within the target")
    for load, metric, stat in keys:
        mine = [next(r for r in rows if (r["model"], r["load"], r["metric"], r["stat"]) == ("all", load, metric, stat))
                for rows in per_run]
        errs = " ".join(f"{100 * r['rel_err']:+6.1f}%" for r in mine)
        print(f"{load:<8} {metric:<10} {stat:<6} {errs}   {sum(within_target(r) for r in mine)}/{len(mine)}")
    hits = [sum(within_target(r) for r in rows if r["model"] == "all") for rows in per_run]
    print(f"within target (all models), per run: {', '.join(f'{h}/{len(keys)}' for h in hits)}")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot_cdfs(path: str, runs: list[tuple[str, list[dict], list[dict]]]) -> str | None:
    """Real vs simulated CDFs of TTFT, TBT and E2E, one row per load; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(runs), len(METRICS), figsize=(4 * len(METRICS), 3 * len(runs)), squeeze=False)
    for i, (load, real, sim) in enumerate(runs):
        for j, metric in enumerate(METRICS):
            ax = axes[i][j]
            for rows, name, style in ((real, "real", "-"), (sim, "simulated", "--")):
                xs = np.sort([1000 * float(r[metric]) for r in rows])
                if len(xs):
                    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, drawstyle="steps-post", label=name)
            ax.set_xlabel(f"{LABEL[metric]} (ms)")
            ax.set_ylabel("CDF")
            ax.set_title(f"{load}: {LABEL[metric]}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
