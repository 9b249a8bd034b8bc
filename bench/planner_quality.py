"""How close the ParaFlex heuristic (Alg. 1 + 2) gets to the exact MILP on small instances.

Usage: python bench/planner_quality.py [--instances 40] [--seed 0]

For each random instance (2-5 models, 4-8 engines, random depths, widths, rates, kappa, ring)
it runs the heuristic, then solves the same replica counts exactly (`milp.solve_placement`)
and prints Phi*(heuristic) / Phi*(optimum); also the heuristic without the polish step, and
whether the heuristic failed where the MILP found a feasible plan (it must never do so), and
how often it stopped replicating (kappa) where an exact placement of the next step exists.
The MILP is the peer measured in the same run. Prints absolute Phi* values and the machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from paraflex.planner import milp
from paraflex.planner.placement_optimizer import optimize
from paraflex.planner.problem import ModelSpec, NoFeasiblePlan, Problem, UniformLayers
from paraflex.planner.replication import choose_next
from paraflex.cpu_info import machine_line


def instance(seed: int) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(4, 8)
    models = []
    for i in range(rng.randint(2, 5)):
        s = rng.randint(1, min(4, n))
        layers = s * rng.randint(2, 6) + rng.randint(0, s - 1)
        layer = rng.randint(5, 10)
        models.append(ModelSpec.from_arch(f"m{i}", layers, s, rng.uniform(0.2, 3.0), UniformLayers(layer, layer // 2, layer // 2)))
    weights = sum(m.weight_bytes for m in models)
    memory = int(weights / n / rng.uniform(0.15, 0.5))  # one replica of everything fills 15-50%
    kappa = int(memory * rng.choice([0.05, 0.1, 0.2]))
    return Problem(tuple(models), n, memory, kappa_bytes=kappa, ring=rng.random() < 0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    print(f"{'inst':>4} {'eng':>3} {'mod':>3} {'ring':>4} {'replicas':>18} {'heur':>8} {'no-pol':>8} {'opt':>8} "
          f"{'ratio':>6} {'raw':>6} {'t_heur':>7} {'t_milp':>7}")
    ratios, raw_ratios, wrong_failures, infeasible, early_stops = [], [], 0, 0, 0
    t_heur_total = t_milp_total = 0.0
    for k in range(args.instances):
        p = instance(args.seed + k)
        t0 = time.perf_counter()
        try:
            h = optimize(p)
            raw = optimize(p, polish=False)
        except NoFeasiblePlan:
            h = None
        t1 = time.perf_counter()
        if h is None:
            exists = milp.solve_placement(p, [1] * len(p.models)) is not None
            wrong_failures += exists
            infeasible += not exists
            print(f"{k:>4} {p.num_engines:>3} {len(p.models):>3} {str(p.ring):>4}  heuristic found no plan; "
                  f"MILP {'FOUND ONE (heuristic failure)' if exists else 'agrees: infeasible'}")
            continue
        reps = [len(r) for r in h.replicas]
        engines, opt, proven = milp.solve_placement(p, reps)
        t2 = time.perf_counter()
        nxt = choose_next(p.num_engines, p.stage_counts, reps, p.ratios)
        if nxt >= 0:  # the heuristic stopped on kappa: could an exact placement take one more step?
            bigger = list(reps)
            bigger[nxt] += 1
            early_stops += milp.solve_placement(p, bigger) is not None
        t_heur_total += t1 - t0
        t_milp_total += t2 - t1
        ratio, raw_ratio = h.objective_bytes / opt, raw.objective_bytes / opt if [len(r) for r in raw.replicas] == reps else float("nan")
        ratios.append(ratio)
        if raw_ratio == raw_ratio:
            raw_ratios.append(raw_ratio)
        print(f"{k:>4} {p.num_engines:>3} {len(p.models):>3} {str(p.ring):>4} {str(reps):>18} {h.objective_bytes:>8.2f} "
              f"{raw.objective_bytes:>8.2f} {opt:>8.2f} {ratio:>6.3f} {raw_ratio:>6.3f} {t1 - t0:>7.3f} {t2 - t1:>7.3f}"
              + ("" if proven else "  (MILP not proven optimal)"))
        sys.stdout.flush()
    print()
    print(f"instances: {args.instances}; feasible: {len(ratios)}; infeasible for both: {infeasible}; "
          f"heuristic failed where a plan exists: {wrong_failures}")
    print(f"heuristic stopped on kappa where an exact placement of Alg. 1's next step exists: {early_stops}")
    print(f"mean Phi*(heuristic)/Phi*(optimum): {sum(ratios) / len(ratios):.4f} (min {min(ratios):.3f}; target >= 0.95)")
    if raw_ratios:
        print(f"without the polish step (same replica counts, {len(raw_ratios)} instances): "
              f"{sum(raw_ratios) / len(raw_ratios):.4f}")
    print(f"time: heuristic {t_heur_total:.2f} s total, MILP {t_milp_total:.2f} s total "
          f"(MILP / heuristic = {t_milp_total / max(t_heur_total, 1e-9):.0f}x)")
    return 0 if wrong_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
