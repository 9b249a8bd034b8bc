"""Paths of the repository the tests run in (configs, bench, the shared data folder beside it),
and the loader of a bench/ script as a module (bench/ is no package)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
BENCH = REPO / "bench"
SHARED = REPO.parent / "shared"


def load_bench(name: str):
    """bench/NAME.py as the module NAME: registered in sys.modules (its dataclasses look their
    module up there), with bench/ on sys.path for the siblings it imports."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
