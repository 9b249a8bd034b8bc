"""Kernel modules that need an optional package (Triton), imported on first use.

Place in the data flow: the worker's CUDA paths (engine/worker/attention.py for paged attention,
engine/worker/model/layer_ops.py for the elementwise layer ops) ask `triton_module` for their
kernel module on the first CUDA batch; without Triton they get None (logged once) and run their
torch formulas instead.
"""

from __future__ import annotations

import functools
import importlib
import logging

log = logging.getLogger(__name__)


@functools.cache
def triton_module(name: str, fallback: str):
    """`paraflex.engine.kernels.<name>`, or None when Triton cannot be imported here (logged
    once, saying that `fallback` runs instead)."""
    try:
        return importlib.import_module(f"paraflex.engine.kernels.{name}")
    except ImportError as exc:
        log.warning("Triton kernels %s unavailable (%s); %s", name, exc, fallback)
        return None
