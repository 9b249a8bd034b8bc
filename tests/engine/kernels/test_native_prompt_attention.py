"""The compiled CPU prompt-attention kernel (csrc/paged_prompt_attention.c) against the torch path:
whole prompts, chunks after cached context and decode tokens in one packed batch."""

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
    assert native_attention.PROMPT_LIBRARY.load() is not None


def _case(g, query_lens, cached, kv_heads, group, head_dim, tpb, num_layers=2, dtype=torch.float32):
    contexts = [q + c for q, c in zip(query_lens, cached)]
    num_blocks = num_layers * sum(-(-n // tpb) for n in contexts) + 8
    cache = KVCache(num_blocks=num_blocks, block_bytes=tpb * 2 * kv_heads * head_dim * dtype.itemsize + 12)
    kv = cache.model_view(kv_heads, head_dim, dtype)
    assert kv.shape[2] == tpb
    kv.copy_(torch.randn(kv.shape, generator=g))  # old contents (and the cached context) everywhere
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[[free.pop() for _ in range(-(-n // tpb))] for n in contexts] for _ in range(num_layers)]
    meta = AttentionMetadata.build(list(query_lens), contexts, tables, tpb)
    t = sum(query_lens)
    q = torch.randn(t, kv_heads * group, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(t, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    return kv, meta, q, k, v


@given(
    requests=st.lists(st.tuples(st.integers(1, 80), st.sampled_from([0, 0, 1, 5, 70])), min_size=1, max_size=4),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([8, 16, 24, 64, 80]),
    tpb=st.sampled_from([1, 3, 7, 16, 21]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_kernel_matches_the_torch_path_and_writes_the_same_slots(requests, kv_heads, group, head_dim, tpb, threads,
                                                                 seed):
    query_lens, cached = zip(*requests)
    if max(query_lens) == 1:  # a decode batch is the decode kernel's
        query_lens = (2,) + query_lens[1:]
    g = torch.Generator().manual_seed(seed)
    kv, meta, q, k, v = _case(g, query_lens, cached, kv_heads, group, head_dim, tpb)
    out, ref, kv, kv_torch = kernel_and_torch_path("prompts_usable", q, k, v, kv, 1, meta, head_dim ** -0.5, threads)
    assert torch.equal(kv, kv_torch)  # the new keys/values landed in the same slots, nothing else moved
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_batches_with_prompts_take_the_kernel_and_other_dtypes_do_not(monkeypatch):
    calls = []
    real = native_attention.prompt_attention
    monkeypatch.setattr(native_attention, "prompt_attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    kv, meta, q, k, v = _case(g, [5, 1], [0, 9], 2, 2, 8, 4)
    paged_attention(q, k, v, kv, 0, meta, 0.3)
    assert calls == [1]
    kv16, meta16, q16, k16, v16 = _case(g, [5, 1], [0, 9], 2, 2, 8, 4, dtype=torch.bfloat16)
    assert not native_attention.prompts_usable(q16, kv16, meta16.max_context)  # bf16: the torch path's rounding
    paged_attention(q16, k16, v16, kv16, 0, meta16, 0.3)
    assert calls == [1]
    bound = native_attention.PROMPT_KERNEL_MAX_CONTEXT
    long_kv, long_meta, lq, lk, lv = _case(g, [3], [bound - 2], 1, 1, 8, 64, num_layers=1)
    assert long_meta.max_context == bound + 1  # past the bound: torch's blocked products are faster there
    paged_attention(lq, lk, lv, long_kv, 0, long_meta, 0.3)
    assert calls == [1]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 300])
def test_softmax_of_extreme_scores_matches_torch(length):
    """Scores spread over hundreds of units (exp underflows for most keys, the running maximum
    moves between chunks of 64 keys) still give torch's weights."""
    g = torch.Generator().manual_seed(length)
    kv, meta, q, k, v = _case(g, [length + 1], [0], 1, 2, 16, 8, num_layers=2)
    out, ref, _, _ = kernel_and_torch_path("prompts_usable", q * 60, k, v, kv, 1, meta, 0.25, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
