"""`paraflex plan`: config -> placement JSON (+ table, optional PNG); `--validate` checks a file.

Thin edge over `paraflex.planner`: loads the config, runs the chosen solver with progress on
stderr, writes the placement file, prints the table; `--validate FILE CONFIG` lists every
constraint violation of an existing placement and exits 2 if there is any.
"""

from __future__ import annotations

import sys
import time

from paraflex.config import load_config
from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.planner import SOLVERS, plan
from paraflex.planner.render import png, table
from paraflex.planner.validate import violations

_MILP_ENGINES = 12  # measured size limit of the exact solver (docs/plan.md)

NAME = "plan"
HELP = "Shard, replicate and place the models of a config onto engines; write placement JSON."


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="cluster/model config (YAML or JSON)")
    parser.add_argument("-o", "--output", default="placement.json", help="placement file to write (default: %(default)s)")
    parser.add_argument("--solver", choices=SOLVERS, default="paraflex",
                        help="paraflex = paper Alg. 1+2 (default); milp = exact (small clusters); "
                             "dedicated, shared, grouped, tensor = baseline layouts")
    parser.add_argument("--png", metavar="FILE", help="also draw the placement (engines as columns) to this PNG")
    parser.add_argument("--time-limit", type=float, default=300.0, metavar="S",
                        help="milp only: total solver time budget in seconds (default: %(default)s)")
    parser.add_argument("--validate", metavar="PLACEMENT",
                        help="check PLACEMENT against CONFIG instead of planning; exit 2 on violations")
    parser.add_argument("-q", "--quiet", action="store_true", help="no table, no progress")


def run(args) -> int:
    if not args.config:
        raise UserError("missing CONFIG: usage `paraflex plan CONFIG -o placement.json`")
    config = load_config(args.config)
    if args.validate:
        return _validate(args.validate, config)
    if args.time_limit is not None and args.time_limit <= 0:
        raise UserError("--time-limit must be > 0 seconds")
    if args.solver == "milp" and config.cluster.num_engines > _MILP_ENGINES:
        print(f"warning: milp proves optimality up to about {_MILP_ENGINES} engines; this cluster has "
              f"{config.cluster.num_engines}, so expect the {args.time_limit:g} s time limit "
              "(the plan is then the best found, params.proven_optimal = false)", file=sys.stderr)
    started = time.monotonic()
    placement = plan(config, solver=args.solver, time_limit=args.time_limit,
                     progress=None if args.quiet else _progress(started))
    for warning in placement.params.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    for problem in violations(placement, config):
        print(f"warning: {args.solver} layout: {problem}", file=sys.stderr)
    placement.save(args.output)
    if args.png:
        png(placement, args.png)
    if not args.quiet:
        print(table(placement))
        print(f"wrote {args.output}" + (f" and {args.png}" if args.png else "")
              + f" in {time.monotonic() - started:.2f} s")
    return 0


def _validate(path: str, config) -> int:
    placement = Placement.load(path, check=False)
    problems = violations(placement, config)
    for p in problems:
        print(p)
    if problems:
        print(f"{path}: {len(problems)} violation(s)", file=sys.stderr)
        return 2
    print(f"{path}: valid for {config.source} ({placement.planner}, Phi* = {placement.objective:.4f})")
    return 0


def _progress(started: float):
    last = [0.0]

    def report(iteration: int, replicas: int, phi_bytes: float) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or iteration == 1:
            last[0] = now
            print(f"  step {iteration}: {replicas} replicas placed, Phi* {phi_bytes / 2**30:.3f} GiB "
                  f"({now - started:.1f} s)", file=sys.stderr)

    return report
