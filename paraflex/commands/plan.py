"""`paraflex plan`: config -> placement JSON (+ table, optional PNG); `--validate` checks a file.

Thin edge over `paraflex.planner`: loads the config, runs the chosen solver with progress on
stderr, writes the placement file, prints the table; `--validate FILE CONFIG` lists every
constraint violation of an existing placement and exits 2 if there is any.
"""

from __future__ import annotations

import os
import sys
import time

from paraflex.config.schema import load_config
from paraflex.models.engine_support import require_runnable
from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.shipped import demo_config_path
from paraflex.planner import SOLVERS, plan
from paraflex.planner.render import png, table
from paraflex.planner.validate import violations

_MILP_ENGINES = 12  # measured size limit of the exact solver (docs/plan.md)

NAME = "plan"
HELP = "Shard, replicate and place the models of a config onto engines; write placement JSON."


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?",
                        help="cluster/model config (YAML or JSON; default: the demo config shipped in the package)")
    parser.add_argument("-o", "--output", help="placement file to write (default: placement.json, or "
                        "placement-SOLVER.json for another --solver, so runs of different solvers keep their files)")
    parser.add_argument("--solver", choices=SOLVERS, default="paraflex",
                        help="paraflex = paper Alg. 1+2 (default); milp = exact (small clusters); "
                             "dedicated, shared, grouped, tensor = baseline layouts")
    parser.add_argument("--png", metavar="FILE", help="also draw the placement (engines as columns) to this PNG")
    parser.add_argument("--time-limit", type=float, default=300.0, metavar="S",
                        help="milp only: total solver time budget in seconds (default: %(default)s)")
    parser.add_argument("--validate", metavar="PLACEMENT",
                        help="check PLACEMENT against CONFIG instead of planning; exit 2 on violations")
    parser.add_argument("--paper-replication", action="store_true",
                        help="ablation: stop replicating as soon as the model Alg. 1 picks cannot get another replica "
                             "(the paper's rule; default: go on with the other models while any fits, "
                             "planner.fill_engines)")
    parser.add_argument("--work-shares", action="store_true",
                        help="Alg. 1's target shares by rate x weight bytes instead of the paper's rate x stage count "
                             "(planner.replica_shares: work)")
    parser.add_argument("--memory-only-placement", action="store_true",
                        help="ablation: the paper's Alg. 2 placement, without the swaps that even the engines' compute "
                             "load (planner.balance_compute: false)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no table, no progress")


def run(args) -> int:
    config = load_config(args.config or demo_config_path())
    if getattr(args, "paper_replication", False):
        config.planner.fill_engines = False
    if getattr(args, "work_shares", False):
        config.planner.replica_shares = "work"
    if getattr(args, "memory_only_placement", False):
        config.planner.balance_compute = False
    if args.validate:
        return _validate(args.validate, config)
    require_runnable(config)
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        raise UserError(f"--time-limit must be a finite number > 0 seconds, got {args.time_limit:g}")
    output = args.output if args.output is not None else default_output(args.solver)
    _check_output("-o", output, "placement.json")
    png_path = _png_output(args.png) if args.png is not None else None
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
    _write("-o", output, placement.save)
    if png_path:
        _write("--png", png_path, lambda path: png(placement, path))
    if not args.quiet:
        print(table(placement))
        print(f"wrote {output}" + (f" and {png_path}" if png_path else "")
              + f" in {time.monotonic() - started:.2f} s")
    return 0


def default_output(solver: str) -> str:
    """The placement file a run of `solver` writes without -o: placement.json for the default
    solver, placement-SOLVER.json for the others."""
    return "placement.json" if solver == "paraflex" else f"placement-{solver}.json"


def _check_output(flag: str, path: str, example: str) -> None:
    """Raise a UserError naming `flag` unless `path` names a file that can be created or replaced
    in an existing directory (checked before planning, so a typo costs no solver time)."""
    if not path:
        raise UserError(f"{flag}: empty file name; pass a file, e.g. {flag} {example}")
    if os.path.isdir(path):
        raise UserError(f"{flag}: {path} is a directory; pass a file name, e.g. {flag} {os.path.join(path, example)}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        problem = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise UserError(f"{flag}: {folder} {problem}; pass a file in an existing directory, e.g. {flag} {example}")


def _png_output(path: str) -> str:
    """The file `--png PATH` draws to: PATH, or PATH.png when PATH has no suffix (as matplotlib
    would name it); a UserError when PATH cannot be written or is not in a format matplotlib draws."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path and not os.path.splitext(path)[1]:
        path += ".png"
    _check_output("--png", path, "placement.png")
    fmt = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise UserError(f"--png: {path}: matplotlib cannot draw .{fmt} files; end the name in .png "
                        f"(or another of its formats: {', '.join(sorted(formats))})")
    return path


def _write(flag: str, path: str, save) -> None:
    """`save(path)`, an OSError (no permission, disk full, ...) as a UserError naming `flag`."""
    try:
        save(path)
    except OSError as exc:
        raise UserError(f"{flag}: cannot write {path} ({exc.strerror or exc}); pass another file") from None


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
