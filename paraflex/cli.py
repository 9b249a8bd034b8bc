"""The `paraflex` command line: discovers subcommands and maps errors to exit codes.

Bad input (`UserError`) prints one line and exits 2; internal failures exit 1 with one
line (set PARAFLEX_DEBUG=1 for the traceback); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import difflib
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
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's 'unrecognized arguments' line, with the closest flag of `parser` to the first
    unknown one (`--sovler` -> did you mean --solver?)."""
    flags = [f for action in parser._actions for f in action.option_strings]
    unknown = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
    close = difflib.get_close_matches(unknown, flags, n=1) if unknown else []
    return f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {close[0]}?)" if close else "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # the subcommand's usage, not the top level's
        command_parser = getattr(args, "_parser", parser)
        command_parser.error(unrecognized(command_parser, extras))
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
