"""The elementwise ops of a decoder layer (RMSNorm, residual add + RMSNorm, rotary embedding of
queries and keys, SiLU(gate) * up), each compiled (engine/kernels/native_ops.py) for CPU float32 and
bfloat16 tensors when the library loads, one Triton kernel each (engine/kernels/triton_layer_ops.py) for CUDA
float16/bfloat16 tensors when Triton imports (`PARAFLEX_TRITON_LAYER_OPS=0` turns them off), else
torch.

Place in the data flow: `DecoderLayer.forward` and `Stage.forward` call these between the
projections; `paraflex profile` (engine/worker/op_profiler.py) times the same functions. Both paths
compute the same formulas; the rotation (and the residual sum) gives the same bits, RMSNorm and
SiLU agree to float32 rounding (sum order, the exponential), in bfloat16 to the last bfloat16 step
(the compiled ops round where the formulas below do; a float32 difference rarely tips a rounding).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from paraflex.engine.kernels import native_ops
from paraflex.engine.kernels.optional import triton_module
from paraflex.engine.worker.model.rope import apply_rotary



def half_kernels(x: torch.Tensor):
    """The Triton layer-op kernels when they take `x` (a CUDA half-precision row batch), else None."""
    if not x.is_cuda or os.environ.get("PARAFLEX_TRITON_LAYER_OPS", "1") == "0":
        return None
    kernels = triton_module("triton_layer_ops", "CUDA layer ops run as torch formulas")
    return kernels if kernels is not None and kernels.serves(x) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like the reference implementation, cast back."""
    if native_ops.applies(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype:
        return native_ops.rms_norm(x, weight, eps)
    if (kernels := half_kernels(x)) is not None and weight.dtype == x.dtype:
        return kernels.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(stream: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add in place (`stream` += `x`; `stream` must be a tensor the caller owns),
    then RMSNorm of the sum."""
    if (native_ops.applies(stream) and stream.dim() == 2 and stream.is_contiguous() and x.is_contiguous()
            and weight.dtype == x.dtype == stream.dtype):
        return native_ops.add_rms_norm(stream, x, weight, eps)
    if (kernels := half_kernels(stream)) is not None and x.stride(-1) == 1 and weight.dtype == stream.dtype == x.dtype:
        return kernels.add_rms_norm(stream, x, weight, eps)
    stream.add_(x)
    return rms_norm(stream, weight, eps)


def rotate_queries_keys(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
                        signed_sin: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each row of `qkv` (queries then keys) rotated by
    `Rotary.cos_sin`, as [tokens, heads, head_dim]; compiled: in place in `qkv`."""
    t = qkv.shape[0]
    if (native_ops.applies(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1 and cos.is_contiguous()
            and signed_sin.is_contiguous() and cos.dtype == signed_sin.dtype == qkv.dtype):
        native_ops.rotary_(qkv, heads, head_dim, cos, signed_sin)
        return qkv[:, : heads * head_dim].view(t, heads, head_dim)
    if (kernels := half_kernels(qkv)) is not None and cos.dtype == qkv.dtype:
        kernels.rotary_(qkv, heads, head_dim, cos, signed_sin)
        return qkv[:, : heads * head_dim].view(t, heads, head_dim)
    return apply_rotary(qkv[:, : heads * head_dim].view(t, heads, head_dim), cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows [gate | up]."""
    if native_ops.applies(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return native_ops.silu_mul(gate_up)
    if (kernels := half_kernels(gate_up)) is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
