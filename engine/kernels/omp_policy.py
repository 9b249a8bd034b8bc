"""How an engine process's OpenMP threads wait between parallel regions (`OMP_WAIT_POLICY`).

Place in the data flow: set before torch loads its OpenMP runtime (libgomp reads the variable
once, when it loads): `paraflex serve` sets it in its own process for the in-process engines
(paraflex/commands/serve.py; `paraflex generate` and `paraflex profile` too, so a profile measures
the engines as they serve) and in each Ray engine actor's environment
(paraflex.engine.ray_engine.engine_actor_class). Imports no torch.

Why PASSIVE: torch's intra-op threads (the prefill's attention, norms) otherwise spin for the
next region after each one ends, and on a CPU engine that spinning takes a core from the
compiled kernels' own pool (engine/kernels/native_build.py) between regions. bench/ttft_split.py
on the 2-core AVX-512 VM, SmolLM2-135M, 128-token prompts: the Ray engine actor's TTFT was 880 ms
(attention 6x, projections 1.5x its in-process time) and fell to 430 ms with PASSIVE; the
in-process engine's went from 555 to 415 ms. A policy set where the server starts is kept.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"


def engine_wait_policy() -> str:
    """The policy engine processes get: the one set in this process's environment, else PASSIVE."""
    return os.environ.get(VARIABLE) or DEFAULT


def apply_here() -> bool:
    """Set the policy in this process's environment; False (and nothing set) when torch is
    already loaded here (too late for its OpenMP runtime to read it)."""
    if "torch" in sys.modules:
        return False
    os.environ[VARIABLE] = engine_wait_policy()
    return True
