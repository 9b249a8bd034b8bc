"""The compiled CPU decode-attention kernel against the torch path, and its build/fallback rules."""

import logging
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.kernels import native_attention, native_build
from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.kv_cache import KVCache
from kernel_cases import kernel_and_torch_path

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine")


def test_the_kernel_builds_on_a_machine_with_a_compiler():
    assert native_attention.load() is not None  # a failed build would only warn: fail here instead


def _decode_case(g, contexts, kv_heads, group, head_dim, tpb, num_layers=2, dtype=torch.float32):
    num_blocks = num_layers * sum(-(-n // tpb) for n in contexts) + 8  # the tables use all but 8 blocks
    cache = KVCache(num_blocks=num_blocks, block_bytes=tpb * 2 * kv_heads * head_dim * dtype.itemsize + 20)
    kv = cache.model_view(kv_heads, head_dim, dtype)
    assert kv.shape[2] == tpb
    kv.copy_(torch.randn(kv.shape, generator=g))  # old contents everywhere, as in a used pool
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[[free.pop() for _ in range(-(-n // tpb))] for n in contexts] for _ in range(num_layers)]
    meta = AttentionMetadata.build([1] * len(contexts), contexts, tables, tpb)
    b = len(contexts)
    q = torch.randn(b, kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(b, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    return kv, meta, q, k, v


@given(
    contexts=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    tpb=st.sampled_from([1, 3, 7, 16]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_kernel_matches_the_torch_path_and_writes_the_same_slots(contexts, kv_heads, group, head_dim, tpb, threads, seed):
    g = torch.Generator().manual_seed(seed)
    kv, meta, q, k, v = _decode_case(g, contexts, kv_heads, group, head_dim, tpb)
    # every thread count asked for is used, however small the batch
    out, ref, kv, kv_torch = kernel_and_torch_path("usable", q, k, v, kv, 1, meta, head_dim ** -0.5, threads)
    assert torch.equal(kv, kv_torch)  # the new key/value landed in the same slots, nothing else moved
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_batches_take_the_kernel_and_prompts_do_not(monkeypatch):
    calls = []
    real = native_attention.decode_attention
    monkeypatch.setattr(native_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    kv, meta, q, k, v = _decode_case(g, [5, 9], 2, 2, 8, 4)
    paged_attention(q, k, v, kv, 0, meta, 0.3)
    assert calls == [1]
    prompt = AttentionMetadata.build([3], [3], [[[7]], [[8]]], 4)
    paged_attention(torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), kv, 0, prompt, 0.3)
    assert calls == [1]
    assert not native_attention.usable(q.double(), kv)
    assert not native_attention.usable(torch.randn(2, 4, 12), kv)  # head_dim not a multiple of 8


@given(
    contexts=st.lists(st.integers(1, 200), min_size=1, max_size=5),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 24, 64]),
    tpb=st.sampled_from([1, 7, 21]),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_bf16_kernel_rounds_like_the_torch_path(contexts, kv_heads, group, head_dim, tpb, seed):
    """bfloat16 pool and queries: the kernel rounds each score, scaled score, probability and
    output to bfloat16 as the torch path's bfloat16 tensors do; only its float32 sums run in
    another order, so results differ at most by a bfloat16 step of a score (~0.4% of a weight)
    and are mostly bit-identical."""
    g = torch.Generator().manual_seed(seed)
    kv, meta, q, k, v = _decode_case(g, contexts, kv_heads, group, head_dim, tpb, dtype=torch.bfloat16)
    assert native_attention.usable(q, kv)
    out, ref, kv, kv_torch = kernel_and_torch_path("usable", q, k, v, kv, 1, meta, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(kv, kv_torch)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -7)
    assert (out == ref).float().mean().item() >= 0.9


def test_mixed_dtypes_take_the_torch_path():
    g = torch.Generator().manual_seed(1)
    kv, _, q, _, _ = _decode_case(g, [5], 1, 2, 8, 4, dtype=torch.bfloat16)
    assert native_attention.usable(q, kv)
    assert not native_attention.usable(q.float(), kv)
    assert not native_attention.usable(q, kv.float())


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An empty cache folder and nothing loaded (the kernel and the thread pool it needs)."""
    monkeypatch.setenv("PARAFLEX_CACHE_DIR", str(tmp_path))
    for lib in (native_attention.LIBRARY, native_build.THREAD_POOL):
        lib.forget()
    yield tmp_path
    for lib in (native_attention.LIBRARY, native_build.THREAD_POOL):
        lib.forget()  # the next test loads from the usual cache again


def test_kernel_is_built_once_per_cache_dir(fresh_loader):
    lib = native_attention.load()
    assert lib is not None
    built = sorted(os.path.join(d, f) for d, _, fs in os.walk(fresh_loader) for f in fs)
    assert [os.path.basename(p).split("-")[0] for p in built] == ["paged_decode_attention", "thread_pool"]
    stamps = [os.stat(p).st_mtime_ns for p in built]
    native_attention.LIBRARY.forget()
    native_build.THREAD_POOL.forget()
    assert native_attention.load() is not None
    assert [os.stat(p).st_mtime_ns for p in built] == stamps  # loaded from the cache, not compiled again


def test_no_compiler_leaves_the_torch_path_with_one_warning(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="paraflex.engine.kernels.native_build"):
        assert native_attention.load() is None
        assert native_attention.load() is None
    assert len(caplog.records) == 1 and "torch path" in caplog.records[0].getMessage()
    assert not native_attention.usable(torch.randn(1, 2, 8), torch.zeros(4, 2, 2, 1, 8))


def test_switched_off_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("PARAFLEX_NATIVE_ATTENTION", "0")
    assert native_attention.load() is None
    assert not os.listdir(fresh_loader)


def test_loading_the_kernel_keeps_subnormal_floats():
    """The library is built without -ffast-math, whose start-up code would set flush-to-zero for
    the whole process (and silently change every float op of torch and numpy after the load)."""
    assert native_attention.load() is not None
    tiny = torch.tensor(1e-38, dtype=torch.float32) * 1e-3
    assert tiny.item() != 0.0
    assert float(np.float32(1e-38) * np.float32(1e-3)) != 0.0


@pytest.mark.parametrize("context", [1, 2, 37, 300])
def test_softmax_of_extreme_scores_matches_torch(context):
    """Scores spread over 200 units (exp underflows for most keys) still give torch's weights."""
    g = torch.Generator().manual_seed(context)
    kv, meta, q, k, v = _decode_case(g, [context], 1, 2, 16, 8, num_layers=1)
    q = q * 60  # scale 0.25: scores of order +-200
    out, ref, _, _ = kernel_and_torch_path("usable", q, k, v, kv, 0, meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rising", [True, False])
def test_maximum_that_moves_between_blocks_matches_torch(rising):
    """float32 runs one pass with an online softmax: when a later block holds a larger score, the
    sums so far are rescaled. Here the scores step by 90 from block to block (beyond the
    exponential's range), upwards or downwards, so each rescale matters or none may happen
    (scores stay within +-90: larger ones would carry float32 rounding of their own)."""
    g = torch.Generator().manual_seed(5)
    tpb, context, head_dim = 4, 12, 16
    kv, meta, q, k, v = _decode_case(g, [context], 1, 2, head_dim, tpb, num_layers=1)
    direction = torch.randn(head_dim, generator=g)
    direction /= direction.norm()
    q[:] = direction * 10  # scale 1: score of slot t = 10 * its key's length along `direction`
    table = meta.block_table[0, 0]
    for t in range(context):
        level = (t // tpb - 1) * (1 if rising else -1)  # -1, 0, 1
        key = direction * (9.0 * level) + 0.01 * torch.randn(head_dim, generator=g)
        kv[table[t // tpb], 0, t % tpb, 0] = key
    k[:] = kv[table[(context - 1) // tpb], 0, (context - 1) % tpb]
    out, ref, _, _ = kernel_and_torch_path("usable", q, k, v, kv, 0, meta, 1.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capability, flags, expected", [
    ("AVX512", {"avx512f", "avx512_bf16"}, ["-mavx512f", "-mavx512vl", "-mfma", "-mavx512bf16"]),
    ("AVX512", {"avx512f"}, ["-mavx512f", "-mavx512vl", "-mfma"]),
    ("AVX2", {"avx2", "avx512_bf16"}, ["-mavx2", "-mfma"]),  # torch held to AVX2: no AVX-512 code at all
    ("DEFAULT", set(), []),
])
def test_bf16_instructions_only_where_the_cpu_has_them(monkeypatch, capability, flags, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(native_build, "cpu_flags", lambda: flags)
    assert native_build.capability_flags() == expected
