"""Dispatch rules on the 3-model CPU mix of bench/multi_model.py, in the simulator.

    python bench/dispatch_rules.py [--rates 1,2,3,4] [--seeds 0,1] [--duration 120]
        [--rules least-load,home-first,home-first:64,least-outstanding] [--target-stage-time 100000]

The bench's models (SmolLM2-135M, a SmolLM2-360M shape, a second 135M) on two `cpu` engines,
the bench's SLOs, 64-token prompts and 32 new tokens, Poisson arrivals under Zipf(1.01) and
balanced popularity; every rule gets the same requests per (popularity, rate, seed). A rule
`home-first:N` is home-first with `home_margin: N`. Prints goodput and throughput per rule and
each rule's goodput against the first one's (docs/engine-core.md, "Least-load dispatch").
Simulated: the `cpu` cost model, no server; seconds per point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from multi_model import MODELS, SMOLLM2, config_dict, popularity_rates, stage_time_arg  # noqa: E402

from paraflex.config.schema import Config  # noqa: E402
from paraflex.simulator.runner import SimSettings, simulate  # noqa: E402
from paraflex.simulator.workload.generator import SimRequest  # noqa: E402

NAMES = ["smollm2-135m", "smollm2-360m-shape", "smollm2-135m-ft"]


def shape_dirs(root: str) -> dict[str, str]:
    """An HF folder holding only config.json per model (the simulator reads the shape alone)."""
    out = {}
    for name in NAMES:
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                       **(MODELS[name][0] or SMOLLM2)}, fh)
        out[name] = path
    return out


def mix_config(dirs: dict[str, str], rates: dict[str, float], rule: str, target_stage_time) -> Config:
    """bench/multi_model.py's ParaFlex config (`config_dict`: 2 engines, about the memory it
    gives them, its scheduler) under `rule`."""
    dispatch, _, margin = rule.partition(":")
    cfg = config_dict({n: {"hf": dirs[n]} for n in NAMES}, rates, 2, 2.7, dispatch, None, target_stage_time)
    if margin:
        cfg["scheduler"]["home_margin"] = int(margin)
    return Config.from_dict(cfg)


def poisson_requests(rates: dict[str, float], duration: float, seed: int) -> list[SimRequest]:
    rng, arrivals = random.Random(seed), []
    for model, rate in rates.items():
        t = rng.expovariate(rate)
        while t < duration:
            arrivals.append((t, model))
            t += rng.expovariate(rate)
    arrivals.sort()
    return [SimRequest(i, m, t, 64, 32) for i, (t, m) in enumerate(arrivals)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1,2,3,4", help="total req/s, comma list")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per point")
    p.add_argument("--rules", default="least-load,home-first,home-first:64,least-outstanding")
    p.add_argument("--target-stage-time", default="100000", help="planner.target_stage_time (100000: every model whole)")
    args = p.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error("--rates and --seeds: comma lists of numbers, e.g. --rates 1,4 --seeds 0,1")
    rules = [r for r in args.rules.split(",") if r]
    tst = stage_time_arg(args.target_stage_time)
    print(f"simulated, `cpu` cost model; {args.duration:g} s of arrivals per point, seeds {seeds}; rules {rules}")
    with tempfile.TemporaryDirectory(prefix="dispatch-rules-") as root:
        dirs = shape_dirs(root)
        print(f"{'popularity':10s} {'req/s':>5s}  " + "  ".join(f"{r:>22s}" for r in rules) + "   (goodput / throughput req/s)")
        for popularity in ("zipf", "balanced"):
            for rate in rates:
                shares = popularity_rates(NAMES, popularity, rate, 1.01)
                cells = []
                for rule in rules:
                    good = thr = 0.0
                    for seed in seeds:
                        s = simulate(mix_config(dirs, shares, rule, tst), SimSettings(system="paraflex", rate=rate, seed=seed),
                                     requests=poisson_requests(shares, args.duration, seed)).summary
                        good += s["goodput_rps"] / len(seeds)
                        thr += s["throughput_rps"] / len(seeds)
                    cells.append((good, thr))
                first = cells[0][0]
                print(f"{popularity:10s} {rate:5g}  " + "  ".join(
                    f"{g:6.2f} / {t:5.2f} ({g / first if first else float('nan'):4.2f}x)" for g, t in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
