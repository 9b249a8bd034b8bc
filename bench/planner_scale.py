"""Planner run time as clusters and model sets grow: 8/64/256 engines x 4/16/64 models.

Usage: python bench/planner_scale.py [--engines 8 64 256] [--models 4 16 64] [--repeat 1]

Instances: models of 1x-10x a base size (depth-scaled, Llama-7B-like layers, embedding and
head on the ends), rates Zipf(1.01), stage counts = round(size / smallest) capped at the
engine count, one replica of everything filling about 35% of the cluster's memory (80 GiB per
engine), kappa = 0.5% of an engine. Prints, per cell, the time of the full ParaFlex planner
(Alg. 1 + 2 + polish), of Alg. 1 + 2 alone (the peer in the same run), the replicas placed and
Phi*, then the growth between sizes. Targets on a 2-core machine: 64 x 16 < 1 s, 256 x 64 < 60 s.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from paraflex.planner.placement_optimizer import optimize
from paraflex.planner.problem import ModelSpec, Problem, UniformLayers
from paraflex.cpu_info import machine_line

GIB = 2**30
LAYER = 202_383_360  # bytes of one Llama-2-7B layer in fp16
EMBED = 131_072_000  # its embedding table


def instance(num_engines: int, num_models: int, seed: int = 0) -> Problem:
    rng = random.Random(seed)
    memory = 80 * GIB
    sizes = [rng.choice([1, 1, 2, 2, 3, 4, 6, 8, 10]) for _ in range(num_models)]
    total_layers = sum(32 * s for s in sizes)
    scale = 0.35 * num_engines * memory / (total_layers * LAYER + num_models * 2 * EMBED)
    models = []
    for i, size in enumerate(sizes):
        layers = max(1, round(32 * size * min(scale, 4.0)))
        stages = min(num_engines, layers, max(1, round(size / min(sizes))))
        rate = 1.0 / (i + 1) ** 1.01
        models.append(ModelSpec.from_arch(f"m{i}", layers, stages, rate, UniformLayers(LAYER, EMBED, EMBED)))
    return Problem(tuple(models), num_engines, memory, kappa_bytes=int(0.005 * memory))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--models", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; the fastest is reported")
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    print(f"{'engines':>7} {'models':>6} {'replicas':>8} {'iters':>6} {'Phi* GiB':>9} {'paraflex s':>11} "
          f"{'alg1+2 s':>9} {'polish share':>12}")
    times: dict[tuple[int, int], float] = {}
    for n in args.engines:
        for m in args.models:
            problem = instance(n, m)
            best = best_raw = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                sol = optimize(problem)
                t1 = time.perf_counter()
                optimize(problem, polish=False)
                t2 = time.perf_counter()
                best, best_raw = min(best, t1 - t0), min(best_raw, t2 - t1)
            times[n, m] = best
            reps = sum(len(r) for r in sol.replicas)
            print(f"{n:>7} {m:>6} {reps:>8} {sol.iterations:>6} {sol.objective_bytes / GIB:>9.2f} {best:>11.3f} "
                  f"{best_raw:>9.3f} {max(0.0, 1 - best_raw / best):>12.0%}")
            sys.stdout.flush()
    print("\ngrowth (time ratio to the previous size):")
    for n in args.engines:
        row = [times[n, m] for m in args.models]
        print(f"  {n:>4} engines, models {' -> '.join(map(str, args.models))}: "
              + ", ".join(f"x{b / max(a, 1e-9):.1f}" for a, b in zip(row, row[1:])))
    for m in args.models:
        col = [times[n, m] for n in args.engines]
        print(f"  {m:>4} models, engines {' -> '.join(map(str, args.engines))}: "
              + ", ".join(f"x{b / max(a, 1e-9):.1f}" for a, b in zip(col, col[1:])))
    if (64, 16) in times:
        print(f"64 x 16: {times[64, 16]:.3f} s (target < 1 s)")
    if (256, 64) in times:
        print(f"256 x 64: {times[256, 64]:.3f} s (target < 60 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
