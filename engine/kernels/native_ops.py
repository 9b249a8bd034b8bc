"""The compiled per-row ops of a CPU float32 or bfloat16 stage (csrc/decoder_layer_ops.c).

Place in the data flow: `engine/worker/model/layer_ops.py` calls these for CPU float32 and
bfloat16 tensors, and the sampler calls `argmax_rows` for greedy picks over CPU float32 logits,
when the library loads (engine/kernels/native_build.py builds it on first use;
PARAFLEX_NATIVE_OPS=0, no compiler or a failed build leave the torch path). Each is one C call
where the torch path runs 3-8 small ops, each with its dispatch and a temporary tensor (bfloat16
more: casts to float32 and back): on SmolLM2 at batch 1 the torch RMSNorm alone took ~75 us per
call. The bfloat16 kernels (`_bf16` in C) round where the torch formulas round. The GIL stays
held (calls of microseconds). Inputs must be contiguous rows (the caller's tensors are fresh
outputs of a `Linear`), all of one dtype.
"""

from __future__ import annotations

import ctypes

import torch

from paraflex.engine.kernels.native_build import THREAD_POOL, NativeLibrary


# the C name's ending for each dtype the kernels take
SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    signatures = {"pf_rms_norm": [ptr, ptr, ptr, i64, i64, f32, i32],
                  "pf_add_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],
                  "pf_rotary": [ptr, i64, i64, i32, i32, ptr, ptr, i32],
                  "pf_silu_mul": [ptr, ptr, i64, i64, i32]}
    for name, argtypes in signatures.items():
        for suffix in SUFFIX.values():
            fn = getattr(lib, name + suffix)
            fn.argtypes, fn.restype = argtypes, None
    lib.pf_argmax_rows.argtypes, lib.pf_argmax_rows.restype = [ptr, i64, i64, ptr], None


def kernel(name: str, dtype: torch.dtype):
    """The C function `name` for tensors of `dtype`."""
    return getattr(LIBRARY.lib, name + SUFFIX[dtype])


# -ffp-contract=off: no fused multiply-adds, so the rotation rounds like the torch path
LIBRARY = NativeLibrary("decoder_layer_ops.c", "PARAFLEX_NATIVE_OPS", "compiled CPU layer ops", _declare,
                        extra_flags=("-ffp-contract=off",), depends=(THREAD_POOL,), hold_gil=True,
                        dtypes=tuple(SUFFIX))


def applies(x: torch.Tensor) -> bool:
    """Whether `x`'s ops run compiled: float32 or bfloat16 on CPU, library loaded."""
    return LIBRARY.serves(x.device, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel("pf_rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                   torch.get_num_threads())
    return out


def add_rms_norm(stream: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(stream)
    kernel("pf_add_rms_norm", stream.dtype)(stream.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                            stream.shape[0], stream.shape[1], eps, torch.get_num_threads())
    return out


def rotary_(rows: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    kernel("pf_rotary", rows.dtype)(rows.data_ptr(), rows.shape[0], rows.stride(0), heads, head_dim,
                                    cos.data_ptr(), signed_sin.data_ptr(), torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    kernel("pf_silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter,
                                         torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for contiguous CPU float32 rows, on the calling thread (torch's
    goes parallel: ~8 ms at batch 32 on two threads when the other core is busy, vs 1.8 on one)."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    LIBRARY.lib.pf_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
