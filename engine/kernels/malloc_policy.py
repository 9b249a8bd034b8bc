"""glibc malloc settings for a CPU engine's process: large activations come back from the heap.

Place in the data flow: `build_engine` (engine/engine_builder.py) calls `apply()` once when it
builds a CPU engine, in the engine's own process (the gateway's for in-process engines, the Ray
actor's otherwise), before the stages run. Imports no torch.

Why: a prefill's activations are tens of MiB each (SmolLM2-135M, 4,096 tokens: 50 MiB for
gate|up alone), and by default glibc gives such blocks fresh mmaps or trims them off the heap's
top when they are freed, so the kernel faults them in and zeroes them again at the next step. With the mmap threshold at its largest
(32 MiB), a generous top pad and no trimming, freed activations are reused from the heap:
on the 2-core AVX-512 VM a 4,096-token SmolLM2 prefill step took 4.1-4.6 s against 4.7-5.7 s
with glibc's defaults (two processes each, 4 steps, alternated; 650k page faults per step
without, none with). vLLM's CPU guide gets the same effect
by preloading tcmalloc. The heap then keeps its peak size (RSS does not shrink after a burst).
`PARAFLEX_MALLOC_TUNING=0` leaves glibc's defaults; elsewhere than glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import os

SWITCH = "PARAFLEX_MALLOC_TUNING"
# mallopt parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 1 << 30), (M_TRIM_THRESHOLD, 2**31 - 1))


def apply() -> bool:
    """Set the engine settings in this process (again: harmless); True if they are in force."""
    if os.environ.get(SWITCH, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
