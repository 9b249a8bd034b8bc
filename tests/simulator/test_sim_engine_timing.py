"""SimEngine's timing equals the cost model's: decode time decomposed (linear part cached per
batch size, attention per context) and prefill time, for random shapes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.models.catalog import get_arch
from paraflex.costs.costmodel import CostModel
from paraflex.simulator.core.sim_engine import SimEngine, StageInfo


class _Pool:
    block_bytes = 32768


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(["llama-2-70b", "internlm2.5-20b-chat", "phi-2"]), tp=st.sampled_from([1, 8]),
       layers=st.integers(1, 40), first=st.booleans(), last=st.booleans(), b=st.integers(1, 64),
       extra=st.integers(0, 200_000), n=st.integers(1, 4096))
def test_stage_times_match_cost_model(model, tp, layers, first, last, b, extra, n):
    arch = get_arch(model)
    cost = CostModel("a100-80g", tp=tp)
    eng = SimEngine(0, None, _Pool(), cost, {}, 1e9)
    info = StageInfo(model, arch, 0, 0, layers, first, last, -1, 0)
    for _ in range(2):  # second call hits the per-batch-size cache
        assert eng.decode_time(info, b, b + extra) == pytest.approx(
            cost.decode_time(arch, layers, b, b + extra, first=first, last=last), rel=1e-9)
    assert eng.prefill_time(info, n, 1) == pytest.approx(cost.prefill_time(arch, layers, n, first=first, last=last), rel=1e-12)


def test_swap_time_is_blocks_over_bandwidth():
    eng = SimEngine(0, None, _Pool(), None, {}, 32e9)
    assert eng.swap_time(1000) == pytest.approx(1000 * 32768 / 32e9)
    assert eng.swap_time(0) == 0.0


@settings(max_examples=60, deadline=None)
@given(device=st.sampled_from(["a100-80g", "h100-80g", "cpu"]), model=st.sampled_from(["llama-2-70b", "phi-2", "tiny-4l"]),
       tp=st.sampled_from([1, 2, 8]), b=st.integers(1, 256), ctx=st.lists(st.integers(0, 2_000_000), min_size=1, max_size=5),
       ratio=st.one_of(st.none(), st.floats(0.05, 20), st.floats(0.9, 1.1),
                       st.sampled_from([0.99, 0.999, 1 - 1e-6, 1.0, 1 + 1e-12, 1 + 1e-10, 1 + 2e-9, 1.001])))
def test_attention_decode_fn_is_bit_identical(device, model, tp, b, ctx, ratio):
    """The replay's per-context attention function gives exactly the cost model's floats, on
    the catalogue's devices (memory-bound: the function skips the FLOP term) and on devices
    whose bandwidth puts the KV stream's time per token at `ratio` x the FLOPs' (ties, near
    ties and compute-bound ones: the function takes the roofline's max)."""
    cost, arch = CostModel(device, tp=tp), get_arch(model)
    ctx = ctx + [1_000_000, 2_000_000]  # long enough for a compute-bound FLOP term to outgrow the stream's
    if ratio is not None:  # stream / FLOP time per token = ratio
        d = cost.device
        per_token_flops = 4.0 * arch.num_heads * arch.head_dim / (d.peak_flops * d.matmul_eff)
        bw = arch.kv_bytes_per_token_per_layer() / (per_token_flops * ratio) / d.mem_eff
        cost = CostModel(dataclasses.replace(d, mem_bandwidth=bw), tp=tp)
    fn, step = cost.attention_decode_fn(arch, b), cost.attention_decode_fn(arch, b, 0.0123, 7)
    for c in ctx:
        assert fn(b + c) == cost.attention_decode_time(arch, b, b + c)
        assert step(b + c) == 0.0123 + 7 * cost.attention_decode_time(arch, b, b + c)
