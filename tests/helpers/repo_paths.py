"""Paths of the repository the tests run in (configs, bench, the shared data folder beside it)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
BENCH = REPO / "bench"
SHARED = REPO.parent / "shared"
