"""Paged attention over the shared byte pool vs plain causal attention on contiguous tensors."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.kernels import native_attention
from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.kv_cache import KVCache

HQ, HKV, D = 4, 2, 8


# The prompt tests run twice on CPU: prompts through the compiled kernel where it builds
# (engine/kernels/native_attention.py), and through the torch code.
PROMPT_PATHS = pytest.mark.parametrize("prompt_path", ["compiled prompts", "torch prompts"])


def on_path(prompt_path: str):
    """A context in which CPU prompts take `prompt_path`."""
    if prompt_path == "torch prompts":
        return mock.patch.object(native_attention, "prompts_usable", lambda *_: False)
    return contextlib.nullcontext()


def _reference(q, k, v):
    """Causal attention of the last len(q) positions over the whole k/v of one request."""
    n, t = k.shape[0], q.shape[0]
    mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(t, HQ * D)


@PROMPT_PATHS
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
    tpb=st.sampled_from([1, 3, 4, 16]),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=40, deadline=None)
def test_paged_matches_contiguous_for_mixed_prefill_chunks_and_decodes(prompt_path, lens, tpb, seed):
    """Every request has `cached` tokens already in the pool and `new` tokens this step
    (new=1 is a decode; cached=0 a fresh prefill; both >0 a prompt chunk)."""
    with on_path(prompt_path):
        g = torch.Generator().manual_seed(seed)
        num_layers = 2
        # the largest draw needs 4 requests x 29 tokens x 2 layers = 232 blocks of one token
        cache = KVCache(num_blocks=256, block_bytes=tpb * 2 * HKV * D * 4 + 12, host_num_blocks=0)
        kv = cache.model_view(HKV, D, torch.float32)
        assert kv.data_ptr() == cache.blocks.data_ptr()  # a view of the one byte tensor, no copy
        free = torch.randperm(256, generator=g).tolist()
        full_k, full_v, tables = [], [], [[] for _ in range(num_layers)]
        for cached, new in lens:
            n = cached + new
            full_k.append(torch.randn(n, HKV, D, generator=g))
            full_v.append(torch.randn(n, HKV, D, generator=g))
            for layer in range(num_layers):
                tables[layer].append([free.pop() for _ in range(-(-n // tpb))])
        layer = 1
        # write the cached context through a first step that "prefills" it
        cached_reqs = [i for i, (c, _) in enumerate(lens) if c > 0]
        if cached_reqs:
            meta0 = AttentionMetadata.build([lens[i][0] for i in cached_reqs], [lens[i][0] for i in cached_reqs],
                                            [[tables[layer_][i] for i in cached_reqs] for layer_ in range(num_layers)], tpb)
            k0 = torch.cat([full_k[i][: lens[i][0]] for i in cached_reqs])
            v0 = torch.cat([full_v[i][: lens[i][0]] for i in cached_reqs])
            paged_attention(torch.randn(k0.shape[0], HQ, D), k0, v0, kv, layer, meta0, D ** -0.5)
        meta = AttentionMetadata.build([n for _, n in lens], [c + n for c, n in lens], tables, tpb)
        qs = [torch.randn(n, HQ, D, generator=g) for _, n in lens]
        k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, lens)])
        v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, lens)])
        out = paged_attention(torch.cat(qs), k_new, v_new, kv, layer, meta, D ** -0.5)
        ref = torch.cat([_reference(q, k, v) for q, k, v in zip(qs, full_k, full_v)])
        assert torch.allclose(out, ref, atol=1e-5)
        expected_pos = torch.cat([torch.arange(c, c + n) for c, n in lens])
        assert torch.equal(meta.positions, expected_pos)


def test_models_of_different_shapes_share_one_pool_without_overlap():
    cache = KVCache(num_blocks=6, block_bytes=1024)
    a = cache.model_view(2, 8, torch.float32)  # 128 B per token -> 8 tokens per block
    b = cache.model_view(1, 4, torch.bfloat16)  # 16 B per token -> 64 tokens per block
    assert (a.shape[2], b.shape[2]) == (8, 64)
    a[2].fill_(1.0)
    b[3].fill_(2.0)
    assert a[2].eq(1.0).all() and b[3].eq(2.0).all()
    assert a[3].abs().sum() > 0  # the same bytes: block 3 seen through model a changed too
    assert a[1].abs().sum() == 0 and b[4].abs().sum() == 0


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_swap_plans_copy_blocks_to_host_and_back(device):
    cache = KVCache(num_blocks=4, block_bytes=256, host_num_blocks=3, device=device)
    assert cache.host_blocks.is_pinned() == (device == "cuda")  # CUDA copies from pinned host memory
    view = cache.model_view(1, 4, torch.float32)
    view[1].fill_(3.0)
    view[2].fill_(4.0)
    cache.swap_out([(1, 2), (2, 0)])
    view[1].zero_()
    view[2].zero_()
    cache.swap_in([(2, 3), (0, 0)])
    assert view[3].eq(3.0).all() and view[0].eq(4.0).all()


@PROMPT_PATHS
@given(prompt_lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), tpb=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_whole_prompts_attend_their_own_keys_and_leave_them_in_the_pool(prompt_path, prompt_lens, tpb, seed):
    """Whole prompts (nothing cached: the causal path over the new keys, prompts of one length
    unpadded, of several lengths padded) give plain causal attention, and a decode step after
    them reads the keys and values they wrote."""
    with on_path(prompt_path):
        g = torch.Generator().manual_seed(seed)
        cache = KVCache(num_blocks=200, block_bytes=tpb * 2 * HKV * D * 4, host_num_blocks=0)
        kv = cache.model_view(HKV, D, torch.float32)
        free = torch.randperm(200, generator=g).tolist()
        tables = [[[free.pop() for _ in range(-(-(n + 1) // tpb))] for n in prompt_lens]]
        ks = [torch.randn(n + 1, HKV, D, generator=g) for n in prompt_lens]
        vs = [torch.randn(n + 1, HKV, D, generator=g) for n in prompt_lens]
        qs = [torch.randn(n, HQ, D, generator=g) for n in prompt_lens]
        meta = AttentionMetadata.build(prompt_lens, prompt_lens, tables, tpb)
        assert meta.fresh
        out = paged_attention(torch.cat(qs), torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]),
                              kv, 0, meta, D ** -0.5)
        ref = torch.cat([_reference(q, k[:-1], v[:-1]) for q, k, v in zip(qs, ks, vs)])
        assert torch.allclose(out, ref, atol=1e-5)
        if max(prompt_lens) > 1 and prompt_path == "torch prompts":  # the whole-prompt path never built the rows
            # that read the context back
            assert next(iter(meta._rows.values()))[0] is None
        step = AttentionMetadata.build([1] * len(prompt_lens), [n + 1 for n in prompt_lens], tables, tpb)
        assert not step.fresh
        q1 = torch.randn(len(prompt_lens), HQ, D, generator=g)
        out1 = paged_attention(q1[:, None].reshape(-1, HQ, D), torch.stack([k[-1] for k in ks]),
                               torch.stack([v[-1] for v in vs]), kv, 0, step, D ** -0.5)
        ref1 = torch.cat([_reference(q1[i:i + 1], k, v) for i, (k, v) in enumerate(zip(ks, vs))])
        assert torch.allclose(out1, ref1, atol=1e-5)
