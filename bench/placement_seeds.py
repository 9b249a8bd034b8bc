"""Same-order placement (Alg. 2) against random placement, with the planner's sharding and
replica counts in both: workload seeds x placement seeds, and whether the engines' expected
compute load tells the winner (issue 26, paper §8.5).

Place in the data flow: plans the config once with the `paraflex` solver and once per
placement seed with `--random-placement` (simulator/systems/random_placement.py: the same
stage cuts and replica counts, stages scattered with the same number per engine, +-1), then
simulates every placement on the requests of every workload seed (Splitwise trace replay, as
bench/reproduce_paper.py does) and prints:

* per workload seed, paraflex's achieved req/s beside the random draws' mean [min-max], and
  paraflex / the random mean over all points with the per-seed ratios' range;
* per placement its expected engine load (`engine_loads`: each model's requests split evenly
  over its replicas, each resident stage costing its share of the model's reference time from
  the cost model), as max / mean and coefficient of variation, beside its mean req/s;
* the variance split of the random draws' req/s (`variance_split`): the spread of the
  placements' means against what the placement x workload interaction alone gives a mean of
  that many seeds (a placement effect smaller than that is not told apart from noise);
* the correlation, within each workload seed, of req/s with the load's coefficient of variation;
* with `--memory-only`, a row for the paper's Alg. 2 without the planner's compute balance
  (`planner.balance_compute: false`);
* with `--extremes`, two more rows: the most and the least compute-balanced same-order
  placements with the planner's replica counts and a Phi* no lower than the planner's
  (`balance_extremes`: exhaustive search, small clusters only), simulated on the same requests:
  what a compute criterion in Alg. 2 could gain at all among placements its memory objective
  does not tell apart.

    python bench/placement_seeds.py configs/paper-base.yaml --popularity balanced --rate 64 \\
        --workload-seeds 0,1,2 --placement-seeds 0,1,2 --duration 20 [--memory-only] [--extremes] [--jobs 2] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from paraflex.cpu_info import machine_line
from paraflex.planner.assemble import to_placement
from paraflex.planner.problem import Solution, replica_engines
from paraflex.planner.replica_placer import water_levels
from paraflex.planner.sharding import build_problem
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from work_bound import TRACE, point_config  # one point's config, as the other benches build it (bench/ is on sys.path)

_TIE = 1e-9
MAX_LEAVES = 2_000_000  # balance_extremes gives up past this many complete placements


def stage_loads(config, placement) -> dict[str, np.ndarray]:
    """Per model, the expected compute of each stage of one of its replicas: the model's rate
    share / its replicas x the stage's work per request (`Problem.stage_work`, the planner's own
    rule: its share of the model's reference time)."""
    problem, _ = build_problem(config)
    works, ratios = problem.stage_work(), problem.ratios
    return {m.name: ratios[i] / placement.models[m.name].num_replicas * np.asarray(works[i])
            for i, m in enumerate(problem.models)}


def engine_loads(config, placement) -> np.ndarray:
    """Expected compute per engine: the sum of `stage_loads` over its resident stages."""
    load = np.zeros(placement.num_engines)
    for name, per_stage in stage_loads(config, placement).items():
        for replica in placement.models[name].replicas:
            for k, engine in enumerate(replica):
                load[engine] += per_stage[k]
    return load


def balance(load: np.ndarray) -> tuple[float, float]:
    """(max / mean, coefficient of variation) of per-engine loads."""
    mean = load.mean()
    return float(load.max() / mean), float(load.std() / mean)


def variance_split(y: np.ndarray) -> tuple[float, float, float]:
    """Standard deviations of a placements x workload-seeds table's placement effect (the rows'
    means), workload effect (the columns' means) and interaction (what is left)."""
    grand = y.mean()
    rows, cols = y.mean(axis=1) - grand, y.mean(axis=0) - grand
    rest = y - grand - rows[:, None] - cols[None, :]
    dof = (y.shape[0] - 1) * (y.shape[1] - 1)
    return float(rows.std(ddof=1)), float(cols.std(ddof=1)), float(np.sqrt((rest ** 2).sum() / dof)) if dof else 0.0


def within_seed_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Correlation of x with y (both placements x workload seeds) after removing each seed's mean."""
    dx, dy = (x - x.mean(axis=0)).ravel(), (y - y.mean(axis=0)).ravel()
    if dx.std() < _TIE or dy.std() < _TIE:
        return float("nan")
    return float(np.corrcoef(dx, dy)[0, 1])


def balance_extremes(config, placement) -> tuple[dict[str, list[list[list[int]]]] | None, int]:
    """The same-order placements (the planner's stage cuts and replica counts, stage k of a replica
    on engine start + k, no two stages of a model on one engine, Phi* no lower than the planner's)
    with the most and the least even compute load: {"most balanced": replicas, "least balanced":
    replicas} (per model, each replica's engines; most balanced = lowest max engine load, then
    lowest spread; least = highest spread), and how many such placements exist. (None, count)
    past MAX_LEAVES."""
    problem, _ = build_problem(config)
    n, memory = problem.num_engines, float(problem.memory_bytes)
    floor = placement.objective * memory * (1 - _TIE)
    per_stage = stage_loads(config, placement)
    units = []  # one per replica: (model index, stage weights, stage loads)
    for i, spec in enumerate(problem.models):
        weights = np.asarray(spec.stage_weights, dtype=float)
        units += [(i, weights, per_stage[spec.name])] * placement.models[spec.name].num_replicas
    units.sort(key=lambda u: (-len(u[1]), -u[1].sum(), u[0]))
    cap, cnt, load = np.full(n, memory), np.zeros(n, dtype=int), np.zeros(n)
    holds = [set() for _ in range(n)]
    starts = [0] * len(units)
    found: dict[str, tuple] = {}  # label -> (key, starts); smaller key wins
    leaves = [0]

    def keep(label: str, key: tuple) -> None:
        if label not in found or key < found[label][0]:
            found[label] = (key, list(starts))

    def place(u: int) -> None:
        if leaves[0] > MAX_LEAVES:
            return
        if u == len(units):
            leaves[0] += 1
            keep("most balanced", (round(float(load.max()), 12), float(load.std())))
            keep("least balanced", (-float(load.std()),))
            return
        i, weights, stage_load = units[u]
        s = len(weights)
        same_model_before = u > 0 and units[u - 1][0] == i  # its replicas in increasing start order
        for p in range(n if problem.ring else n - s + 1):
            if same_model_before and p <= starts[u - 1]:
                continue
            window = replica_engines(p, s, n)
            if any(i in holds[e] or cap[e] < weights[k] for k, e in enumerate(window)):
                continue
            for k, e in enumerate(window):
                cap[e] -= weights[k]
                cnt[e] += 1
                load[e] += stage_load[k]
                holds[e].add(i)
            starts[u] = p
            if water_levels(cap, cnt).min() >= floor:
                place(u + 1)
            for k, e in enumerate(window):
                cap[e] += weights[k]
                cnt[e] -= 1
                load[e] -= stage_load[k]
                holds[e].discard(i)

    place(0)
    if leaves[0] > MAX_LEAVES:
        return None, leaves[0]
    out = {}
    for label, (_, chosen) in found.items():
        replicas = [[] for _ in problem.models]
        for (i, weights, _), p in zip(units, chosen):
            replicas[i].append(replica_engines(p, len(weights), n))
        out[label] = replicas
    return out, leaves[0]


PLANNER = "paraflex"
MEMORY_ONLY = "paraflex, memory only"  # the paper's Alg. 2 (planner.balance_compute: false)
EXTREMES = ("most balanced", "least balanced")


def layout_of(config, label: str):
    """The layout of one placement: the planner's (`PLANNER`; `MEMORY_ONLY`: without its compute
    balance), its random draw `random N`, or one of `EXTREMES` (`balance_extremes`, placed with
    the planner's cuts and replica counts)."""
    if label.startswith("random "):
        return build_system(config, SimSettings(system="paraflex", random_placement=True, seed=int(label.split()[1])))
    if label == MEMORY_ONLY:
        return build_system(config, SimSettings(system="paraflex", memory_only_placement=True))
    layout = build_system(config, SimSettings(system="paraflex"))
    if label in EXTREMES:
        extremes, count = balance_extremes(config, layout.placement)
        if extremes is None:
            raise SystemExit(f"--extremes: more than {MAX_LEAVES} same-order placements; not searched to the end")
        problem, _ = build_problem(config)
        layout.placement = to_placement(problem, Solution(replicas=extremes[label], objective_bytes=0.0),
                                        f"paraflex ({label})", layout.placement.params)
    elif label != PLANNER:
        raise ValueError(f"unknown placement {label!r}")
    return layout


@dataclasses.dataclass(frozen=True)
class Point:
    config_path: str
    popularity: str
    duration: float
    trace: str | None  # None: the config's own arrivals
    rate: float
    placement: str  # a `layout_of` label
    workload_seed: int


def run_point(point: Point) -> dict:
    config = point_config(point.config_path, point.popularity, point.duration, point.trace)
    layout = layout_of(config, point.placement)
    summary = simulate(config, SimSettings(system="paraflex", rate=point.rate, seed=point.workload_seed), layout=layout).summary
    return {"placement": point.placement, "workload_seed": point.workload_seed,
            "throughput_rps": summary["throughput_rps"], "e2e_median_s": summary["e2e_median_s"],
            "e2e_p99_s": summary["e2e_p99_s"]}


def report(config, rows: list[dict], placement_seeds: list[int], workload_seeds: list[int]) -> list[str]:
    """The tables as Markdown lines."""
    tput = {(r["placement"], r["workload_seed"]): r["throughput_rps"] for r in rows}
    drawn = [f"random {p}" for p in placement_seeds]
    ours = np.array([tput[PLANNER, w] for w in workload_seeds])
    rand = np.array([[tput[p, w] for w in workload_seeds] for p in drawn])
    lines = ["| workload seed | paraflex req/s | random req/s, mean [min-max] | ratio |", "|---|---|---|---|"]
    for j, w in enumerate(workload_seeds):
        col = rand[:, j]
        lines.append(f"| {w} | {ours[j]:.1f} | {col.mean():.1f} [{col.min():.1f}-{col.max():.1f}] | {ours[j] / col.mean():.2f} |")
    ratios = ours / rand.mean(axis=0)
    lines += ["", f"paraflex / random: {ours.mean() / rand.mean():.3f} (per workload seed {ratios.min():.2f}-{ratios.max():.2f}; "
              f"{len(workload_seeds)} workload x {len(placement_seeds)} placement seeds)", ""]
    labels = [PLANNER, *drawn, *[x for x in (MEMORY_ONLY, *EXTREMES) if (x, workload_seeds[0]) in tput]]
    shape = {p: balance(engine_loads(config, layout_of(config, p).placement)) for p in labels}
    lines += ["| placement | load max/mean | load CV | mean req/s | × paraflex (per workload seed) |", "|---|---|---|---|---|"]
    for p in labels:
        per_seed = np.array([tput[p, w] for w in workload_seeds]) / ours
        lines.append(f"| {p} | {shape[p][0]:.3f} | {shape[p][1]:.3f} | {statistics.mean(tput[p, w] for w in workload_seeds):.2f} "
                     f"| {per_seed.mean():.3f} [{per_seed.min():.2f}-{per_seed.max():.2f}] |")
    if len(placement_seeds) > 1 and len(workload_seeds) > 1:
        sd_p, sd_w, sd_i = variance_split(rand)
        cv = np.array([[shape[p][1]] * len(workload_seeds) for p in drawn])
        lines += ["", f"random draws: placement effect sd {sd_p:.2f} req/s against {sd_i / np.sqrt(len(workload_seeds)):.2f} "
                  f"from the interaction alone (interaction sd {sd_i:.2f} / sqrt({len(workload_seeds)}) seeds); workload "
                  f"effect sd {sd_w:.2f}; within-seed correlation of req/s with the load CV {within_seed_correlation(cv, rand):+.2f}"]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--popularity", default="balanced", help="balanced or a Zipf exponent (as bench/reproduce_paper.py)")
    ap.add_argument("--rate", type=float, required=True, help="offered req/s over all models")
    ap.add_argument("--duration", type=float, default=20.0, help="arrival window, s")
    ap.add_argument("--trace", default=TRACE, help="arrival trace to replay (default: Splitwise conversation)")
    ap.add_argument("--workload-seeds", default="0,1,2")
    ap.add_argument("--placement-seeds", default="0,1,2")
    ap.add_argument("--memory-only", action="store_true", help="also simulate the paper's memory-only Alg. 2 placement "
                    "(planner.balance_compute: false)")
    ap.add_argument("--extremes", action="store_true", help="also simulate the most and the least compute-balanced "
                    "same-order placements with the planner's replica counts and Phi* (exhaustive search: small clusters)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="JSON file for the points")
    a = ap.parse_args()
    ws = [int(x) for x in a.workload_seeds.split(",")]
    ps = [int(x) for x in a.placement_seeds.split(",")]
    config = point_config(a.config, a.popularity, a.duration, a.trace)
    labels = [PLANNER, *[f"random {p}" for p in ps], *((MEMORY_ONLY,) if a.memory_only else ()), *(EXTREMES if a.extremes else ())]
    points = [Point(a.config, a.popularity, a.duration, a.trace, a.rate, p, w) for p in labels for w in ws]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        rows = list(pool.map(run_point, points))
    print(f"# {a.config}, popularity {a.popularity}, {a.rate:g} req/s offered, {a.duration:g} s windows; "
          f"{len(points)} points in {time.perf_counter() - t0:.0f} s wall; {machine_line()}")
    print("\n".join(report(config, rows, ps, ws)))
    if a.extremes:
        _, count = balance_extremes(config, layout_of(config, PLANNER).placement)
        print(f"\n(most / least balanced: of the {count} same-order placements with the planner's replica counts and a Phi* "
              "no lower than the planner's)")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
