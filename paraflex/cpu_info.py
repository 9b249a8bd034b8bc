"""The CPU this process runs on, as /proc/cpuinfo names it: model name and feature flags.

Place in the data flow: torch-free, at the bottom layer, so every benchmark (pure planner and
simulator ones included) prints the same machine line (`machine_line`), and the compiled kernels
(engine/kernels/native_build.py) and the layout chooser read the flags from one place. CPUs differ
between the machines the project meets (AVX2 on some, AVX-512 with bf16 / AMX on others), so a
measured figure means little without this line.
"""

from __future__ import annotations

import os
import platform

# The vector features that change what the CPU kernels (ours, oneDNN's, vLLM's) can do.
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
                     "neon", "asimd")


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags (`flags` on x86, `Features` on Arm; empty where unknown)."""
    fields = cpuinfo_fields()
    return set((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model() -> str:
    """The CPU's model name, else what `platform` knows."""
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def machine_line() -> str:
    """One line for a benchmark's report: CPU model, CPU count, the flags of interest present,
    Python's version and the load average now (a busy machine's timings say so)."""
    flags = cpu_flags()
    present = ",".join(f for f in FLAGS_OF_INTEREST if f in flags) or "-"
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    return (f"{cpu_model()}, {os.cpu_count()} CPUs, flags {present}, "
            f"Python {platform.python_version()}, load average {load}")
