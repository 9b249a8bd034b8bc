"""Shared pytest fixtures. Heavy fixtures (a Ray session, built checkpoints) live here so the
whole session shares one instance."""

import os
import sys
from pathlib import Path

import pytest
import torch

# Where no GPU is visible, the Triton kernels run on CPU tensors under Triton's interpreter; the
# flag must be set before Triton is first imported (its language functions are built at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test modules import the shared helpers (tests/helpers/) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """ONE local Ray instance for the whole test session (temp dir under pytest's tmp, few
    CPUs, no dashboard, worker logs not echoed); shut down when the session ends."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), namespace="paraflex-tests")
    try:
        yield ray
    finally:
        ray.shutdown()
