"""Accelerator specifications: datasheet peaks plus the few calibrated efficiency constants.

Place in the data flow: `paraflex.config.schema` validates `cluster.device` against these names and
sizes default memory from them; `paraflex.costs.costmodel.CostModel` turns a `DeviceSpec` into
per-stage times. Peaks are vendor datasheet numbers (sources in docs/costmodel.md); the
efficiency constants (fraction of peak a real kernel reaches, fixed per-kernel launch cost)
are fitted once against the measured Vidur tables in ``shared/data/profiles`` by
``bench/costmodel_fidelity.py`` and are documented as fitted, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraflex.errors import UserError

GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense 16-bit tensor FLOP/s (fp32 for the CPU)
    mem_bandwidth: float  # bytes/s of device memory
    memory_bytes: int
    intra_bandwidth: float  # bytes/s, all-reduce bus bandwidth inside a TP group (NVLink; fitted)
    intra_latency: float  # s, one ring step of a collective inside a TP group (fitted)
    # Fitted efficiencies (see docs/costmodel.md, "Calibration").
    matmul_eff: float = 0.7  # fraction of peak_flops a large GEMM reaches
    mem_eff: float = 0.8  # fraction of mem_bandwidth a streaming kernel reaches
    kernel_overhead: float = 5e-6  # s, fixed cost per kernel launch
    matmul_half_tokens: float = 64.0  # GEMM efficiency ramps as n / (n + half) for n tokens


_DEVICES = {
    d.name: d
    for d in [
        # A generic laptop/desktop CPU running float32 PyTorch on a few cores.
        DeviceSpec("cpu", peak_flops=2.0e11, mem_bandwidth=2.0e10, memory_bytes=16 * GIB,
                   intra_bandwidth=1.0e10, intra_latency=2e-5,
                   matmul_eff=0.5, mem_eff=0.6, kernel_overhead=2e-5, matmul_half_tokens=4.0),
        # NVIDIA A100 SXM4 80GB: 312 TFLOPS BF16 dense, 2039 GB/s HBM2e, NVLink3 600 GB/s total.
        # Efficiencies and NVLink all-reduce constants fitted by
        # `bench/costmodel_fidelity.py --fit` on the Vidur A100 (DGX) tables.
        DeviceSpec("a100-80g", peak_flops=312e12, mem_bandwidth=2.039e12, memory_bytes=80 * GIB,
                   intra_bandwidth=147.7e9, intra_latency=3.65e-6,
                   matmul_eff=0.722, mem_eff=0.776, kernel_overhead=4.85e-6, matmul_half_tokens=59.9),
        # NVIDIA H100 SXM5 80GB: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, NVLink4 900 GB/s total.
        # Fitted the same way on the Vidur H100 (DGX) tables.
        DeviceSpec("h100-80g", peak_flops=989e12, mem_bandwidth=3.35e12, memory_bytes=80 * GIB,
                   intra_bandwidth=309.4e9, intra_latency=2.1e-6,
                   matmul_eff=0.70, mem_eff=0.90, kernel_overhead=4.78e-6, matmul_half_tokens=118.0),
        # NVIDIA H200 SXM 141GB: same compute as H100, 4.8 TB/s HBM3e. No measured tables:
        # it borrows the H100's fitted efficiencies (same GPU die and software stack).
        DeviceSpec("h200", peak_flops=989e12, mem_bandwidth=4.8e12, memory_bytes=140 * GIB,
                   intra_bandwidth=309.4e9, intra_latency=2.1e-6,
                   matmul_eff=0.70, mem_eff=0.90, kernel_overhead=4.78e-6, matmul_half_tokens=118.0),
    ]
}

_ALIASES = {"a100": "a100-80g", "h100": "h100-80g", "h200-141g": "h200"}


def device_names() -> list[str]:
    return list(_DEVICES)


def get_device(name: str) -> DeviceSpec:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return _DEVICES[key]
    except KeyError:
        raise UserError(f"unknown device {name!r}; choose one of: {', '.join(_DEVICES)}") from None
