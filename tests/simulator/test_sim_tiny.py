"""Hand-checkable simulations: known stage and hop times -> exact latencies."""

from __future__ import annotations

import pytest

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import SystemLayout
from paraflex.simulator.workload import SimRequest

P, D = 0.1, 0.01  # seconds: any prefill stage, any decode stage


class FixedCost:
    """A cost model with constant stage times, so latencies can be worked out by hand."""

    def prefill_time(self, arch, num_layers, num_tokens, first=False, last=False, num_seqs=1):
        return P

    def decode_time(self, arch, num_layers, batch_size, total_context, first=False, last=False):
        return D

    def attention_decode_time(self, arch, batch_size, total_context):
        return 0.0

    def attention_decode_fn(self, arch, batch_size, plus=0.0, times=1):
        return lambda total_context: plus


def _config(engines, policy="full-batch-first", gbps=8.0, latency_us=1000.0, pack_prompts=False):
    # A GPU device with the paper's one prompt per prefill batch (`pack_prompts: false`, §8.1),
    # unless asked; stage times come from FixedCost, not the device.
    return Config.from_dict({
        "cluster": {"num_engines": engines, "device": "a100-80g", "memory_gb": 1, "interconnect_gbps": gbps,
                    "interconnect_latency_us": latency_us},
        "models": [{"name": "m", "arch": "tiny-2l"}],
        "scheduler": {"max_batch_size": 32, "policy": policy, "pack_prompts": pack_prompts},
    })


def _layout(config, stages):
    layers = config.models[0].arch.num_layers
    cuts = [(0, layers)] if stages == 1 else [(0, layers // 2), (layers // 2, layers)]
    placement = Placement(1, "hand", {}, 0.0, {"m": ModelPlacement("m", layers, cuts, [list(range(stages))])},
                          [EnginePlacement(e, [StageRef("m", 0, e)], 0, {}) for e in range(stages)])
    return SystemLayout("hand", placement, config.scheduler.policy, 1, config.cluster.memory_bytes)


def _run(config, stages, reqs):
    res = simulate(config, SimSettings(check_invariants=True), layout=_layout(config, stages), cost=FixedCost(), requests=reqs)
    return {r.id: r for r in res.metrics.requests.values()}, res


def test_one_request_one_engine():
    recs, res = _run(_config(1), 1, [SimRequest(0, "m", 0.0, 10, 3)])
    r = recs[0]
    assert r.first_token == pytest.approx(P)
    assert r.finish == pytest.approx(P + 2 * D)
    assert r.tokens == 3
    s = res.summary
    assert s["e2e_median_s"] == pytest.approx(P + 2 * D)
    assert s["ttft_median_s"] == pytest.approx(P)
    assert s["tbt_median_s"] == pytest.approx(D)
    assert s["prefill_batches"] == 1 and s["decode_batches"] == 2
    assert s["active_gpu_share_mean"] == pytest.approx(1.0)


def test_two_requests_full_batch_first_prefills_one_at_a_time():
    # t=0: prefill r0 (one prompt per prefill batch, §8.1); t=P: prefill r1 (prefills before an
    # under-sized decode batch); t=2P: one decode batch {r0, r1} -> both second tokens at 2P + D
    recs, res = _run(_config(1), 1, [SimRequest(0, "m", 0.0, 10, 2), SimRequest(1, "m", 0.0, 10, 2)])
    assert recs[0].first_token == pytest.approx(P) and recs[1].first_token == pytest.approx(2 * P)
    assert recs[0].finish == pytest.approx(2 * P + D) and recs[1].finish == pytest.approx(2 * P + D)
    assert res.summary["decode_batch_size_mean"] == 2


def test_two_requests_full_batch_first_packs_waiting_prompts_by_default():
    # scheduler.pack_prompts (the default): both waiting prompts in one prefill batch at t=0,
    # then one decode batch {r0, r1}: tokens at P and P + D
    recs, res = _run(_config(1, pack_prompts=True), 1, [SimRequest(0, "m", 0.0, 10, 2), SimRequest(1, "m", 0.0, 10, 2)])
    assert recs[0].first_token == pytest.approx(P) and recs[1].first_token == pytest.approx(P)
    assert recs[0].finish == pytest.approx(P + D) and recs[1].finish == pytest.approx(P + D)
    assert res.summary["prefill_batches"] == 1 and res.summary["decode_batch_size_mean"] == 2


def test_two_requests_prefill_first_packs_prompts():
    # prefill-first (vLLM-like) packs both prompts into one prefill batch: tokens at P, P + D
    recs, res = _run(_config(1, "prefill-first"), 1, [SimRequest(0, "m", 0.0, 10, 2), SimRequest(1, "m", 0.0, 10, 2)])
    assert recs[0].first_token == pytest.approx(P) and recs[1].first_token == pytest.approx(P)
    assert recs[0].finish == pytest.approx(P + D) and recs[1].finish == pytest.approx(P + D)
    assert res.summary["prefill_batches"] == 1


def test_two_stage_pipeline_hop_and_token_latency():
    cfg = _config(2, gbps=8.0, latency_us=1000.0)  # 1 GB/s, 1 ms
    recs, res = _run(cfg, 2, [SimRequest(0, "m", 0.0, 10, 2)])
    arch = cfg.models[0].arch
    lat, bw = 1e-3, 1e9
    hop_prefill = lat + CostModel.hidden_bytes(arch, 10) / bw
    hop_decode = lat + CostModel.hidden_bytes(arch, 1) / bw
    first = P + hop_prefill + P  # stage 0, hop, stage 1 samples token 1
    second = first + lat + D + hop_decode + D  # token back to stage 0, decode both stages
    assert recs[0].first_token == pytest.approx(first)
    assert recs[0].finish == pytest.approx(second)
    assert res.summary["hops"] == 2


def test_slo_attainment_counts_tokens_against_deadlines():
    # Aegaeon: token k is due at arrival + TTFT_slo + k * TBT_slo
    cfg = _config(1)
    cfg.models[0].slo_ttft_ms = 105.0
    cfg.models[0].slo_tbt_ms = 5.0
    recs, res = _run(cfg, 1, [SimRequest(0, "m", 0.0, 10, 3)])
    # token times 0.100, 0.110, 0.120 vs deadlines 0.105, 0.110, 0.115 -> 2 of 3 on time
    assert recs[0].on_time == 2
    assert res.summary["slo_attainment"] == pytest.approx(2 / 3)
    assert res.summary["goodput_rps"] == 0.0
