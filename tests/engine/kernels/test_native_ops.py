"""The compiled elementwise ops of a CPU float32 or bfloat16 layer against their torch formulas,
and a whole stage with them against the same stage without them."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_models import VOCAB, build_llama, run_stages

from paraflex.models.arch_files import arch_from_hf_config
from paraflex.engine.kernels import native_build, native_ops
from paraflex.engine.worker.model import Stage
from paraflex.engine.worker.model import layer_ops
from paraflex.engine.worker.model.rope import Rotary
from paraflex.engine.worker.weights import load_stage_weights

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine")


def test_the_library_builds_on_a_machine_with_a_compiler():
    assert native_ops.LIBRARY.load() is not None  # a failed build would only warn: fail here instead


def torch_path():
    """The layer ops with the compiled library switched off."""
    return mock.patch.object(native_ops, "applies", lambda *_: False)


def _rows(seed, rows, width, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g) * scale


@given(rows=st.integers(1, 9), width=st.integers(1, 70), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_add_rms_norm_matches_torch(rows, width, scale, seed):
    stream, x = _rows(seed, rows, width, scale), _rows(seed + 1, rows, width, scale)
    weight = _rows(seed + 2, 1, width)[0]
    stream_ref = stream.clone()
    out = layer_ops.add_rms_norm(stream, x, weight, 1e-5)
    with torch_path():
        ref = layer_ops.add_rms_norm(stream_ref, x, weight, 1e-5)
        assert torch.equal(stream, stream_ref)  # the same float additions
        torch.testing.assert_close(layer_ops.rms_norm(x, weight, 1e-6), _norm_native(x, weight, 1e-6),
                                   rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


def _norm_native(x, weight, eps):
    assert native_ops.LIBRARY.lib is not None
    return native_ops.rms_norm(x, weight, eps)


@given(tokens=st.integers(1, 6), heads=st.integers(1, 5), extra=st.integers(0, 3),
       head_dim=st.sampled_from([2, 8, 16, 24, 64]), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=80, deadline=None)
def test_rotation_gives_the_torch_bits_and_leaves_the_values_alone(tokens, heads, extra, head_dim, seed, dtype):
    qkv = _rows(seed, tokens, (heads + extra) * head_dim, 10.0).to(dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=torch.Generator().manual_seed(seed))
    cos, sin = Rotary(head_dim, 10000.0, None, "cpu").cos_sin(positions, dtype)
    before = qkv.clone()
    rotated = layer_ops.rotate_queries_keys(qkv, heads, head_dim, cos, sin)
    assert rotated.data_ptr() == qkv.data_ptr()  # the compiled path: rotated in place
    with torch_path():
        ref = layer_ops.rotate_queries_keys(before, heads, head_dim, cos, sin)
    assert torch.equal(rotated, ref)
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])


@given(rows=st.integers(1, 5), inter=st.integers(1, 40), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_silu_mul_matches_torch_including_large_gates(rows, inter, seed):
    gate_up = _rows(seed, rows, 2 * inter, 30.0)  # gates far into both tails of the sigmoid
    out = layer_ops.silu_mul(gate_up)
    with torch_path():
        ref = layer_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, ref, rtol=3e-6, atol=1e-6)


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor, tiny: float = 1e-30) -> int:
    """The most bfloat16 steps between a and b, element by element (their bits as integers), over
    the pairs not both below `tiny` in size (SiLU of a gate below -88: the compiled exponential is
    clamped there, giving ~1e-35 where torch gives 0)."""
    assert a.dtype == b.dtype == torch.bfloat16
    counted = (a.float().abs() >= tiny) | (b.float().abs() >= tiny)
    apart = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()[counted]
    return int(apart.max()) if apart.numel() else 0


@given(rows=st.integers(1, 9), width=st.integers(1, 70), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_bf16_add_rms_norm_gives_the_torch_sum_and_a_norm_within_two_steps(rows, width, scale, seed):
    bf16 = torch.bfloat16
    stream, x = _rows(seed, rows, width, scale).to(bf16), _rows(seed + 1, rows, width, scale).to(bf16)
    weight = _rows(seed + 2, 1, width)[0].to(bf16)
    stream_ref = stream.clone()
    out = layer_ops.add_rms_norm(stream, x, weight, 1e-5)
    assert native_ops.applies(stream)
    with torch_path():
        ref = layer_ops.add_rms_norm(stream_ref, x, weight, 1e-5)
        norm_ref = layer_ops.rms_norm(x, weight, 1e-6)
    assert torch.equal(stream, stream_ref)  # the same rounded additions
    # Both round the normalised row to bfloat16 and then its product with the weight. Their float32
    # inverse RMS may differ in its last bit (another summation order), which can tip the first
    # rounding by one step; one step of the row moves the exact product by less than two of the
    # product's steps (the ratio of the two mantissas is below 2), so the rounded products are at
    # most two steps apart (CI met an example two steps apart at a row of scale 1e-3).
    assert bf16_steps_apart(out, ref) <= 2
    assert bf16_steps_apart(_norm_native(x, weight, 1e-6), norm_ref) <= 2


@given(rows=st.integers(1, 5), inter=st.integers(1, 40), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_bf16_silu_mul_within_one_step_of_torch(rows, inter, seed):
    gate_up = _rows(seed, rows, 2 * inter, 30.0).to(torch.bfloat16)
    out = layer_ops.silu_mul(gate_up)
    with torch_path():
        ref = layer_ops.silu_mul(gate_up)
    assert bf16_steps_apart(out, ref) <= 1  # the exponentials differ in float32's last bits (and the clamp)


def test_bf16_ops_are_mostly_bit_identical_at_smollm2_widths():
    """Over 32 rows of SmolLM2's widths the one-step differences are rare: at most 1 value in 1000."""
    g = torch.Generator().manual_seed(7)
    bf16 = torch.bfloat16
    stream, x = torch.randn(32, 576, generator=g).to(bf16), torch.randn(32, 576, generator=g).to(bf16)
    weight, gate_up = torch.randn(576, generator=g).to(bf16), (torch.randn(32, 3072, generator=g) * 4).to(bf16)
    outs = (layer_ops.add_rms_norm(stream.clone(), x, weight, 1e-5), layer_ops.silu_mul(gate_up))
    with torch_path():
        refs = (layer_ops.add_rms_norm(stream.clone(), x, weight, 1e-5), layer_ops.silu_mul(gate_up))
    for out, ref in zip(outs, refs):
        assert bf16_steps_apart(out, ref) <= 1
        assert (out != ref).sum().item() <= out.numel() // 1000


def test_mixed_dtypes_and_strided_inputs_take_the_torch_path():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    weight32 = torch.randn(16)
    calls = []
    with mock.patch.object(native_ops, "rms_norm", lambda *a: calls.append(1)):
        ref = layer_ops.rms_norm(x, weight32, 1e-5)  # a float32 weight on bfloat16 rows: the torch formula
    assert calls == [] and ref.dtype == torch.float32
    wide = torch.randn(3, 32)
    strided = wide[:, ::2]
    weight = torch.randn(16)
    with torch_path():
        ref = layer_ops.rms_norm(strided.contiguous(), weight, 1e-5)
    torch.testing.assert_close(layer_ops.rms_norm(strided, weight, 1e-5), ref)


def test_a_stage_with_the_compiled_ops_matches_it_without(tmp_path):
    build_llama(tmp_path)
    arch = arch_from_hf_config(str(tmp_path))
    cuts = [(0, 1), (1, arch.num_layers)]
    stages = [Stage(arch, a, b, load_stage_weights(str(tmp_path), arch, a, b, source_kind="hf")) for a, b in cuts]
    tpb, lens = 4, [5, 11]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=g)
    perm = torch.randperm(100, generator=g).tolist()
    tables = [[perm[(l * 2 + i) * 4:(l * 2 + i) * 4 + 4] for i in range(2)] for l in range(arch.num_layers)]

    def run():
        return run_stages(stages, ids, lens, lens, torch.zeros(100, 2, tpb, arch.num_kv_heads, arch.head_dim),
                          tables, tpb)

    used = []
    real = native_ops.silu_mul
    with mock.patch.object(native_ops, "silu_mul", lambda t: used.append(t.shape) or real(t)):
        compiled = run()
    assert len(used) == arch.num_layers  # every layer took the compiled ops
    with torch_path():
        plain = run()
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)


@given(rows=st.integers(1, 4), n=st.integers(1, 40), ties=st.booleans(), nan_at=st.none() | st.integers(0, 39),
       seed=st.integers(0, 10_000))
@settings(max_examples=80, deadline=None)
def test_argmax_rows_is_torch_argmax_with_ties_and_nans(rows, n, ties, nan_at, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if ties:  # few distinct values: the first largest must win
        x = (x * 2).round()
    if nan_at is not None and nan_at < n:
        x[-1, nan_at] = float("nan")
    assert torch.equal(native_ops.argmax_rows(x), x.argmax(-1))


def test_greedy_sampling_takes_the_compiled_argmax():
    from paraflex.engine.core.sampling_params import SamplingParams
    from paraflex.engine.worker.sampling import Sampler

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    calls = []
    real = native_ops.argmax_rows
    with mock.patch.object(native_ops, "argmax_rows", lambda t: calls.append(1) or real(t)):
        result = Sampler().sample(logits, ["a", "b", "c"], [SamplingParams(temperature=0.0)] * 3)
    assert calls == [1]
    assert list(result.token_ids) == logits.argmax(-1).tolist()


def test_prompt_sized_rows_split_over_threads_give_the_same_results():
    """Above 65,536 floats the row loops run on the kernels' thread pool: same values as one thread."""
    g = torch.Generator().manual_seed(5)
    stream, x, weight = torch.randn(300, 512, generator=g), torch.randn(300, 512, generator=g), torch.randn(512)
    gate_up, qkv = torch.randn(300, 512, generator=g), torch.randn(300, 12 * 64, generator=g)
    cos, sin = Rotary(64, 10000.0, None, "cpu").cos_sin(torch.arange(300), torch.float32)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            s, q = stream.clone(), qkv.clone()
            results.append((layer_ops.add_rms_norm(s, x, weight, 1e-5), s, layer_ops.rms_norm(x, weight, 1e-5),
                            layer_ops.silu_mul(gate_up), layer_ops.rotate_queries_keys(q, 12, 64, cos, sin)))
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(*results):
        assert torch.equal(one, two)
    with torch_path():
        torch.testing.assert_close(results[0][3], layer_ops.silu_mul(gate_up), rtol=3e-6, atol=1e-6)
