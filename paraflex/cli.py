"""The `paraflex` command line: discovers subcommands and maps errors to exit codes.

Bad input (`UserError`) prints one line and exits 2; internal failures exit 1 with one
line (set PARAFLEX_DEBUG=1 for the traceback); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import traceback

import paraflex
import paraflex.commands
from paraflex.errors import ParaflexError


def _command_modules():
    for info in sorted(pkgutil.iter_modules(paraflex.commands.__path__), key=lambda m: m.name):
        yield importlib.import_module(f"paraflex.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paraflex",
        description="Serve many heterogeneous LLMs on one shared accelerator pool "
        "(unaligned pipelines, DRF placement, autonomous engines).",
    )
    parser.add_argument("--version", action="version", version=f"paraflex {paraflex.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ParaflexError as exc:
        print(f"paraflex {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"paraflex {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an internal bug: one line for users, traceback on request
        if os.environ.get("PARAFLEX_DEBUG"):
            traceback.print_exc()
        print(
            f"paraflex {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set PARAFLEX_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
