"""CPU serving choices of the torch engine: packed prefill, a lazily committed KV pool, and the
decode attention path (grouped-query matmuls over the row-gathered context)."""

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_models import make_placement

from paraflex.config.scheduler import CPU_PREFILL_TOKEN_BUDGET
from paraflex.config.schema import Config
from paraflex.engine.kernels import native_attention
from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.kv_cache import KVCache
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster

torch.set_num_threads(1)


def _config(budget=None):
    sched = {"block_bytes": 4096, "max_batch_size": 8}
    if budget is not None:
        sched["prefill_token_budget"] = budget
    return Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}],
        "scheduler": sched,
    })


def test_scheduler_options_pack_prompts_and_pack_prompts_false_is_the_paper_setting_on_gpu():
    sc = _config().scheduler
    assert sc.engine_options(on_cpu=True)["prefill_max_requests"] == 8
    assert sc.engine_options(on_cpu=False)["prefill_max_requests"] == 8
    sc.pack_prompts = False
    assert "prefill_max_requests" not in sc.engine_options(on_cpu=False)  # one prompt per prefill batch (§8.1)
    assert sc.engine_options(on_cpu=True)["prefill_max_requests"] == 8  # a CPU engine packs whatever
    budgeted = _config(budget=64).scheduler.engine_options(on_cpu=False)
    assert budgeted["prefill_token_budget"] == 64 and budgeted["prefill_max_requests"] == 8


def test_a_cpu_engine_prefills_in_steps_of_2048_tokens_unless_the_config_sets_a_budget():
    sc = _config().scheduler
    assert sc.engine_options(on_cpu=True)["prefill_token_budget"] == CPU_PREFILL_TOKEN_BUDGET == 2048
    assert "prefill_token_budget" not in sc.engine_options(on_cpu=False)  # the scheduler's 4096
    assert _config(budget=4096).scheduler.engine_options(on_cpu=True)["prefill_token_budget"] == 4096


@pytest.mark.parametrize("budget, prefill_batches", [(None, 1), (12, 2), (11, 3)])
def test_waiting_prompts_share_prefill_batches_under_the_budget(budget, prefill_batches):
    cluster = LLMCluster(_config(budget), make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 1), kv_bytes=1 << 20)
    prompts = [[256, 1, 2, 3, 4, 5], [256, 7, 8, 9, 10, 11], [256, 20, 21, 22, 23, 24]]
    results = cluster.generate("tiny-2l", prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert all(len(r.token_ids) == 1 for r in results)
    assert cluster.engines[0].stats["batches"] == prefill_batches  # 3 prompts x 6 tokens
    # packing changes batching, not results: each prompt alone gives the same token
    alone = [cluster.generate("tiny-2l", [p], SamplingParams(max_tokens=1, temperature=0))[0].token_ids for p in prompts]
    assert [r.token_ids for r in results] == alone


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_cpu_kv_pool_is_zero_and_costs_memory_only_where_written():
    before = _rss_bytes()
    cache = KVCache(num_blocks=16384, block_bytes=65536)  # 1 GiB
    view = cache.model_view(2, 8, torch.float32)
    assert cache.blocks.shape == (16384, 65536) and view.data_ptr() == cache.blocks.data_ptr()
    assert float(view[[0, 9000, 16383]].abs().sum()) == 0.0
    view[5].fill_(1.0)
    assert float(view[5].sum()) == view[5].numel() and float(view[6].abs().sum()) == 0.0
    assert _rss_bytes() - before < 256 << 20  # far below the 1 GiB mapped


def _decode_reference(q, k, v):
    """One query (the last position) over the whole k/v of one request, grouped-query heads."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], enable_gqa=True)
    return out[0].transpose(0, 1).reshape(1, -1)


@given(contexts=st.lists(st.integers(1, 40), min_size=1, max_size=5), slack=st.sampled_from([0, 4, 12]),
       seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_decode_batch_of_uneven_contexts_matches_contiguous_attention(contexts, slack, seed):
    """Decode (one new token per request) reads the context through the row table; `slack`
    bytes at the end of each block make rows shorter than a head vector (the general case)."""
    hq, hkv, d, tpb = 6, 2, 8, 4
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(num_blocks=64, block_bytes=tpb * 2 * hkv * d * 4 + slack)
    kv = cache.model_view(hkv, d, torch.float32)
    free = torch.randperm(64, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // tpb))] for n in contexts]
    ks = [torch.randn(n, hkv, d, generator=g) for n in contexts]
    vs = [torch.randn(n, hkv, d, generator=g) for n in contexts]
    prefix = [i for i, n in enumerate(contexts) if n > 1]
    if prefix:  # write every context but its last token through a prefill step
        meta0 = AttentionMetadata.build([contexts[i] - 1 for i in prefix], [contexts[i] - 1 for i in prefix],
                                        [[tables[i] for i in prefix]], tpb)
        paged_attention(torch.randn(sum(contexts[i] - 1 for i in prefix), hq, d),
                        torch.cat([ks[i][:-1] for i in prefix]), torch.cat([vs[i][:-1] for i in prefix]),
                        kv, 0, meta0, d ** -0.5)
    meta = AttentionMetadata.build([1] * len(contexts), contexts, [tables], tpb)
    assert meta.query_index is None and (meta.context.bias is None) == (len(set(contexts)) == 1)
    q = torch.randn(len(contexts), hq, d, generator=g)
    ref = torch.cat([_decode_reference(q[i:i + 1], ks[i], vs[i]) for i in range(len(contexts))])
    k_new, v_new = torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs])
    with mock.patch.object(native_attention, "usable", lambda *_: False):  # the torch path's row table
        out = paged_attention(q, k_new, v_new, kv, 0, meta, d ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5)
    if native_attention.load() is not None:  # and the compiled kernel over the same blocks
        assert torch.allclose(paged_attention(q, k_new, v_new, kv, 0, meta, d ** -0.5), ref, atol=1e-5)
