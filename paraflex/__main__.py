"""`python -m paraflex` runs the CLI."""

from paraflex.cli import main

if __name__ == "__main__":  # a spawned worker process (gateway/body_workers.py) imports this module too
    raise SystemExit(main())
