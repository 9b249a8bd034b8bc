"""The elementwise ops of a decoder layer (RMSNorm, residual add + RMSNorm, rotary embedding of
queries and keys, SiLU(gate) * up), each compiled (engine/kernels/native_ops.py) for CPU float32 tensors
when the library loads, else torch.

Place in the data flow: `DecoderLayer.forward` and `Stage.forward` call these between the
projections; `paraflex profile` (engine/worker/op_profiler.py) times the same functions. Both paths
compute the same formulas; the rotation gives the same bits, RMSNorm and SiLU agree to float32
rounding (sum order, the exponential).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraflex.engine.kernels import native_ops
from paraflex.engine.worker.model.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like the reference implementation, cast back."""
    if native_ops.applies(x) and x.dim() == 2 and x.is_contiguous():
        return native_ops.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(stream: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add in place (`stream` += `x`; `stream` must be a tensor the caller owns),
    then RMSNorm of the sum."""
    if native_ops.applies(stream) and stream.dim() == 2 and stream.is_contiguous() and x.is_contiguous():
        return native_ops.add_rms_norm(stream, x, weight, eps)
    stream.add_(x)
    return rms_norm(stream, weight, eps)


def rotate_queries_keys(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
                        signed_sin: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each row of `qkv` (queries then keys) rotated by
    `Rotary.cos_sin`, as [tokens, heads, head_dim]; compiled: in place in `qkv`."""
    t = qkv.shape[0]
    if (native_ops.applies(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1 and cos.dtype == torch.float32
            and cos.is_contiguous() and signed_sin.is_contiguous()):
        native_ops.rotary_(qkv, heads, head_dim, cos, signed_sin)
        return qkv[:, : heads * head_dim].view(t, heads, head_dim)
    return apply_rotary(qkv[:, : heads * head_dim].view(t, heads, head_dim), cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows [gate | up]."""
    if native_ops.applies(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return native_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
