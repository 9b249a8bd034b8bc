"""`python -m paraflex` runs the CLI."""

from paraflex.cli import main

raise SystemExit(main())
