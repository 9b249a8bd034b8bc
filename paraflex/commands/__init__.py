"""One module per `paraflex` subcommand.

Each module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`;
`paraflex.cli` discovers them, so adding a subcommand touches no other file.
"""
