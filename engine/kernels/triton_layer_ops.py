"""Triton kernels for the elementwise ops of a decoder layer on a GPU in half precision.

Place in the data flow: `engine/worker/model/layer_ops.py` calls these for CUDA float16/bfloat16
tensors (the serving dtypes on a GPU); CPU float32 and bfloat16 take the compiled C ops
(engine/kernels/native_ops.py), everything else the torch formulas. Each op here is one kernel
launch where the torch formulas launch 2-9 (RMSNorm alone: cast, square, mean, add, rsqrt,
multiply, cast, multiply): ~20 fewer launches per layer, which is what a batch-1 decode step
inside a CUDA graph pays for (each launch a few microseconds against ~140 us of weights per
layer of a 7B model on an H100).

Each kernel rounds where the torch formulas round (every torch op on a half tensor computes in
float32 and rounds its result to the tensor's dtype), so the two paths agree to the last bit
but for the float32 rsqrt/exp of the device against torch's; the rotation is compiled without fused
multiply-adds (`enable_fp_fusion=False`: with them the H100 build differed from torch in the
last bit of some rotated values). float32 stays on the torch path:
its greedy tokens are held equal to the `transformers` reference bit for bit.

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1`), which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16)
ELEMENTWISE_BLOCK = 1024


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels take `x`: half precision rows with a contiguous last dimension."""
    return x.dtype in DTYPES and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) of rows x [T, N] (the torch formula of layer_ops.rms_norm)."""
    out = torch.empty_like(x)
    _norm(x, x, weight, out, eps, add=False)
    return out


def add_rms_norm(stream: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`stream` += `x` in place, then weight * RMSNorm(stream)."""
    out = torch.empty_like(stream)
    _norm(stream, x, weight, out, eps, add=True)
    return out


def _norm(stream, x, weight, out, eps: float, add: bool) -> None:
    rows, n = stream.shape
    if rows == 0:
        return
    _rms_norm_kernel[(rows,)](stream, x, weight, out, n, stream.stride(0), x.stride(0), out.stride(0), eps,
                              ADD=add, BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))


def rotary_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of qkv [T, >= heads * head_dim] in place by
    `Rotary.cos_sin` ([T, 1, head_dim] each, qkv's dtype): x * cos + roll(x) * signed_sin."""
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    cos, signed_sin = cos.reshape(tokens, head_dim), signed_sin.reshape(tokens, head_dim)
    _rotary_kernel[(tokens, heads)](qkv, cos, signed_sin, qkv.stride(0), cos.stride(0), signed_sin.stride(0),
                                    HEAD_DIM=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
                                    enable_fp_fusion=False)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows [gate | up] of gate_up [T, 2F]; returns [T, F]."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(half, ELEMENTWISE_BLOCK))](
            gate_up, out, half, gate_up.stride(0), out.stride(0), BLOCK=ELEMENTWISE_BLOCK)
    return out


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


@triton.jit
def _rms_norm_kernel(STREAM, X, W, OUT, N, stride_stream, stride_x, stride_out, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    s = tl.load(STREAM + row * stride_stream + cols, mask=mask, other=0.0)
    if ADD:  # the residual add rounds to the stream's dtype, as `stream.add_(x)` does
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + x.to(tl.float32)).to(s.dtype)
        tl.store(STREAM + row * stride_stream + cols, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / N
    normed = (sf * (1.0 / tl.sqrt(var + eps))).to(s.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(s.dtype), mask=mask)


@triton.jit
def _rotary_kernel(QKV, COS, SIN, stride_row, stride_cos, stride_sin,
                   HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    mask = i < half
    base = QKV + token * stride_row + head * HEAD_DIM
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + half + i, mask=mask, other=0.0)
    dtype = x1.dtype
    cos1 = tl.load(COS + token * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + token * stride_cos + half + i, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + token * stride_sin + i, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + token * stride_sin + half + i, mask=mask, other=0.0).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos and roll(x) * signed_sin each round to the dtype before their sum does
    out1 = ((f1 * cos1).to(dtype).to(tl.float32) + (f2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * cos2).to(dtype).to(tl.float32) + (f1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + i, out1, mask=mask)
    tl.store(base + half + i, out2, mask=mask)


@triton.jit
def _silu_mul_kernel(GATE_UP, OUT, HALF, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HALF
    gate = tl.load(GATE_UP + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(GATE_UP + row * stride_in + HALF + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds, then `mul_` rounds
    tl.store(OUT + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)
