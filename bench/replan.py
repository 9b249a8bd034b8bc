"""Live re-planning on the §8.2 cluster: static placement vs live re-planning vs an oracle.

Usage: python bench/replan.py [--rate 24] [--duration 240] [--interval 30] [--out bench-results/replan]

Two drifting workloads on configs/paper-base.yaml (Poisson arrivals, the config's Zipf shares
as each model's base rate):
* shift: halfway through, the most popular model (internlm2.5-20b-chat-1) and
  codellama-34b-instruct swap their rates;
* diurnal: a day compressed into the run: the two internlm models swing between 0.3x and 1.7x
  of their rate, the two larger models the same half a period later.
Three ways to serve each, all through the same simulated machinery (block pools over the whole
memory, every step an event), so only the placement differs:
* static: the placement planned for the config's rates, never changed;
* live: `ReplanController` every --interval s (or on a rate jump), measured rates only;
* oracle: knows the schedule: re-plans (no hysteresis) a few seconds before each phase for
  that phase's mean rates (shift: 2 phases; diurnal: 8 per period).
Prints SLO attainment, goodput, P99 TTFT, weight bytes moved, and P99 TTFT per time bin; writes
replan.csv and (with matplotlib) replan_ttft.png under --out. Machine and wall time printed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import time

import numpy as np

from paraflex.config.schema import load_config
from paraflex.planner.incremental import IncrementalPlanner
from paraflex.planner.replan_controller import Replan
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from paraflex.simulator.workload.schedule import RateSchedule
from paraflex.cpu_info import machine_line

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "paper-base.yaml")
NEVER = 1e12  # an interval and threshold no run reaches: the static peer
LEAD_S = 5.0  # the oracle re-plans this long before a phase starts (loads take < 1 s here)


class OracleController:
    """The controller's interface, re-planning for known future rates at fixed instants."""

    def __init__(self, config, placement, phases: list[tuple[float, dict]]):
        self.planner = IncrementalPlanner(config, hysteresis=0.0)
        self.placement = placement
        self.phases = list(phases)  # (instant, rates of the phase that starts LEAD_S later)

    def observe(self, model: str, t: float) -> None:
        pass

    def maybe_replan(self, now: float) -> Replan | None:
        if not self.phases or now < self.phases[0][0]:
            return None
        _, rates = self.phases.pop(0)
        result = self.planner.replan(self.placement, rates)
        if not result.changed:
            return None
        self.placement = result.placement
        return Replan(now, result.placement, result.actions, result.rates, result.objective_before, result.objective_after, "oracle")


def scenarios(config, rate: float, horizon: float) -> dict[str, tuple[dict, list[tuple[float, dict]]]]:
    """name -> (schedules, oracle phases)."""
    names = [m.name for m in config.models]
    shares = dict(zip(names, config.workload.model_shares(config.models)))
    top, grow = names[0], names[2]
    half = horizon / 2
    shift = {top: RateSchedule.steps([(0, 1.0), (half, shares[grow] / shares[top])]),
             grow: RateSchedule.steps([(0, 1.0), (half, shares[top] / shares[grow])])}
    diurnal = {m: RateSchedule.diurnal(horizon, 0.3, 1.7, horizon, phase_s=0.0 if k < 2 else horizon / 2)
               for k, m in enumerate(names)}
    out = {}
    for name, sched, cuts in (("shift", shift, [0.0, half]), ("diurnal", diurnal, list(np.linspace(0, horizon, 9)[:-1]))):
        phases = []
        for k, start in enumerate(cuts):
            end = cuts[k + 1] if k + 1 < len(cuts) else horizon
            mean = {m: rate * shares[m] * _mean(sched.get(m), start, end) for m in names}
            phases.append((max(0.0, start - LEAD_S), mean))
        out[name] = (sched, phases)
    return out


def _mean(schedule, start: float, end: float) -> float:
    if schedule is None:
        return 1.0
    return (schedule.cumulative(end) - schedule.cumulative(start)) / (end - start)


def ttft_p99_over_time(result, bin_s: float, horizon: float) -> list[float | None]:
    bins = [[] for _ in range(int(np.ceil(horizon / bin_s)))]
    for r in result.metrics.requests.values():
        k = int(r.arrival // bin_s)
        if k < len(bins) and r.first_token >= 0:
            bins[k].append(r.first_token - r.arrival)
    return [float(np.percentile(b, 99)) if b else None for b in bins]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=24.0, help="total base rate, req/s")
    ap.add_argument("--duration", type=float, default=240.0, help="arrival window, s")
    ap.add_argument("--interval", type=float, default=30.0, help="live re-planning interval, s")
    ap.add_argument("--bin", type=float, default=20.0, help="time bin of the P99 TTFT curve, s")
    ap.add_argument("--out", default=os.path.join("bench-results", "replan"))
    args = ap.parse_args()
    config = load_config(CONFIG)
    config.workload = dataclasses.replace(config.workload, arrival="poisson", duration_s=args.duration)
    print(f"machine: {machine_line()}; config paper-base "
          f"(8 engines x 8 A100-80G), Poisson, base rate {args.rate:g} req/s, {args.duration:g} s, interval {args.interval:g} s")
    os.makedirs(args.out, exist_ok=True)
    rows, curves = [], {}
    header = f"{'workload':<8} {'system':<7} {'SLO att.':>8} {'goodput':>8} {'TTFT P99':>9} {'changes':>7} {'moved GiB':>9} {'wall s':>6}"
    print(header)
    for name, (sched, phases) in scenarios(config, args.rate, args.duration).items():
        for system in ("static", "live", "oracle"):
            interval = args.interval if system == "live" else NEVER
            settings = SimSettings(rate=args.rate, seed=0, replan_interval=interval,
                                   replan_threshold=0.5 if system == "live" else NEVER)
            controller = None
            if system == "oracle":
                layout = build_system(config, settings)
                controller = OracleController(config, layout.placement, phases)
            t0 = time.perf_counter()
            res = simulate(config, settings, schedules=sched, controller=controller)
            wall = time.perf_counter() - t0
            s, live = res.summary, res.summary["live_replanning"]
            curves[(name, system)] = ttft_p99_over_time(res, args.bin, args.duration)
            row = {"workload": name, "system": system, "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
                   "ttft_p99_s": s["ttft_p99_s"], "changes": live["replans"], "moved_gib": live["moved_weight_bytes"] / 2**30,
                   "requests": s["requests"], "wall_s": wall}
            rows.append(row)
            print(f"{name:<8} {system:<7} {row['slo_attainment']:>8.3f} {row['goodput_rps']:>8.2f} {row['ttft_p99_s']:>9.2f} "
                  f"{row['changes']:>7} {row['moved_gib']:>9.1f} {wall:>6.1f}", flush=True)
    with open(os.path.join(args.out, "replan.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"P99 TTFT (s) per {args.bin:g} s bin of arrival time:")
    for (name, system), curve in curves.items():
        print(f"  {name:<8} {system:<7} " + " ".join("  -  " if v is None else f"{v:5.2f}" for v in curve))
    _plot(curves, args.bin, args.out)


def _plot(curves, bin_s: float, out: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    names = sorted({n for n, _ in curves})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4))
    for ax, name in zip(np.atleast_1d(axes), names):
        for (n, system), curve in curves.items():
            if n == name:
                ax.plot([(k + 0.5) * bin_s for k in range(len(curve))], [np.nan if v is None else v for v in curve], label=system)
        ax.set_title(name)
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("P99 TTFT (s)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "replan_ttft.png")
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
