"""The Triton layer-op kernels against the torch formulas of engine/worker/model/layer_ops.py.

On CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where
no GPU is visible); the `gpu` twins run the same cases compiled on CUDA. Whole bf16 models run
through them in bench/gpu_check.py (greedy tokens against `transformers`, decode step speed)."""

import os

import pytest
import torch
from kernel_devices import DEVICES, needs_cuda

from paraflex.engine.worker.model import layer_ops
from paraflex.engine.worker.model.rope import Rotary, apply_rotary

ops = pytest.importorskip("paraflex.engine.kernels.triton_layer_ops")

DTYPES = [torch.bfloat16, torch.float16]


def _rows(t, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, generator=g) * 3).to(dtype).to(device)


def _torch_norm(x, w, eps):  # the formula of layer_ops.rms_norm, on the CPU
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _same(got, want):
    """Equal bits, except bfloat16 under the interpreter: its float32 -> bfloat16 cast truncates
    where the GPU (and torch) round to nearest, so there each rounding may be one unit in the
    last place of the operands' scale off (a wrong index or sign is off by the operands)."""
    got = got.cpu()
    if got.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 * torch.finfo(want.dtype).eps * scale)
    else:
        assert torch.equal(got, want)


def _close(got, want):
    # one rounding step of the dtype apart at most (the device's rsqrt/exp against torch's)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=3 * torch.finfo(want.dtype).eps, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 64), (3, 200), (5, 96)])
def test_rms_norm_and_residual_add(device, dtype, t, n):
    x, r, w = _rows(t, n, dtype, device), _rows(t, n, dtype, device, 1), _rows(1, n, dtype, device, 2)[0]
    _close(ops.rms_norm(x, w, 1e-5), _torch_norm(x.cpu(), w.cpu(), 1e-5))
    stream = x.clone()
    out = ops.add_rms_norm(stream, r, w, 1e-6)
    summed = x.cpu() + r.cpu()
    _same(stream, summed)  # the add rounds like torch's, in place
    _close(out, _torch_norm(summed, w.cpu(), 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24)])
def test_rotary_in_place_matches_the_torch_rotation(device, dtype, heads, kv_heads, head_dim):
    t = 5
    qkv = _rows(t, (heads + 2 * kv_heads) * head_dim, dtype, device)
    cos, sin = Rotary(head_dim, 10000.0, None, "cpu").cos_sin(torch.tensor([0, 3, 7, 100, 2047]), dtype)
    n = heads + kv_heads
    want = apply_rotary(qkv.cpu()[:, : n * head_dim].view(t, n, head_dim), cos, sin)
    before = qkv.cpu()
    ops.rotary_(qkv, n, head_dim, cos.to(device), sin.to(device))
    _same(qkv[:, : n * head_dim].view(t, n, head_dim), want)
    assert torch.equal(qkv.cpu()[:, n * head_dim:], before[:, n * head_dim:])  # values untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,f", [(1, 48), (4, 1500)])  # 1500: two column blocks, the last one ragged
def test_silu_mul(device, dtype, t, f):
    gate_up = _rows(t, 2 * f, dtype, device)
    gate, up = gate_up.cpu().chunk(2, dim=-1)
    _close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate).mul_(up))


def test_dispatch_takes_half_precision_cuda_rows_only():
    assert layer_ops.half_kernels(torch.zeros(2, 8, dtype=torch.bfloat16)) is None  # CPU: C ops or torch
    assert ops.serves(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not ops.serves(torch.zeros(2, 8))  # float32: the exact torch path
    assert not ops.serves(torch.zeros(8, 2, dtype=torch.float16).t())  # last dim not contiguous


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_ops_dispatch_to_the_kernels_on_cuda(dtype):
    x, w = _rows(3, 64, dtype, "cuda"), _rows(1, 64, dtype, "cuda", 2)[0]
    assert layer_ops.half_kernels(x) is ops
    _close(layer_ops.rms_norm(x, w, 1e-5), _torch_norm(x.cpu(), w.cpu(), 1e-5))


def test_without_triton_the_kernels_are_none_and_said_once(monkeypatch, caplog):
    import builtins

    from paraflex.engine.kernels import optional

    real_import = builtins.__import__

    def no_triton(name, *args, **kw):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kw)

    optional.triton_module.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.delitem(__import__("sys").modules, "paraflex.engine.kernels.triton_layer_ops")
    try:
        assert optional.triton_module("triton_layer_ops", "torch formulas") is None
        assert optional.triton_module("triton_layer_ops", "torch formulas") is None
        assert [r.getMessage() for r in caplog.records].count(
            "Triton kernels triton_layer_ops unavailable (No module named 'triton'); torch formulas") == 1
    finally:
        optional.triton_module.cache_clear()
