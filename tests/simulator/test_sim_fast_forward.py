"""The decode fast-forward (simulator/fastpath/fast_forward.py, EngineScheduler.advance_*_decode) gives
exactly the results of the step-by-step event path: per-request rows and the summary are
identical (equal floats, not approximately), on random workloads over pipelines, shared
engines, memory pressure and every policy; and the bulk scheduler calls leave the state that
k rounds of the driving protocol leave (same contexts, same blocks in the same order)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


from paraflex.config.schema import WorkloadConfig, load_config
from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.scheduler import EngineScheduler, ProtocolError
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from repo_paths import CONFIGS
from sim_cases import assert_same_results, ring_config, ring_layout

def _both(cfg, layout, system, rate, seed, check=False):
    res = {}
    for ff in (True, False):
        res[ff] = simulate(cfg, SimSettings(system=system, rate=rate, seed=seed, fast_forward=ff, check_invariants=check),
                           layout=layout)
    return res[True], res[False]


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["full-batch-first", "prefill-first", "sarathi"]),
       memory_gb=st.sampled_from([0.012, 0.02, 0.05]), max_batch=st.sampled_from([2, 8]),
       rate=st.sampled_from([5.0, 40.0]), cv=st.sampled_from([1.0, 4.0]))
def test_ring_pipelines_identical_with_and_without_fast_forward(seed, policy, memory_gb, max_batch, rate, cv):
    """Three models of 1, 2 and 3 stages on a ring of three engines (every engine shared)."""
    w = WorkloadConfig(arrival="lognormal", cv=cv, num_requests=20, seed=seed, output_scale=0.5)
    cfg = ring_config(memory_gb, policy, max_batch, w)
    fast, plain = _both(cfg, ring_layout(cfg, policy), "ring", rate, seed, check=True)
    assert_same_results(fast, plain)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [2.0, 8.0])
def test_ring_fast_forward_runs_and_cuts_events(rate):
    w = WorkloadConfig(arrival="lognormal", cv=2.0, num_requests=40, seed=3, output_scale=1.0)
    cfg = ring_config(0.05, "full-batch-first", 8, w)
    fast, plain = _both(cfg, ring_layout(cfg, "full-batch-first"), "ring", rate, 3)
    assert_same_results(fast, plain)
    assert fast.summary["fast_forward_cycles"] > 100
    assert fast.summary["events"] < plain.summary["events"] * 0.8


@pytest.mark.parametrize("system,engines,rate", [("paraflex", 8, 4.0), ("paraflex", 2, 4.0),
                                                 pytest.param("sarathi", 8, 4.0, marks=pytest.mark.slow)])
def test_paper_base_identical(system, engines, rate):
    """The §8.2 base case (ParaFlex placement: replicas and a 3-stage model sharing engines)."""
    path = str(CONFIGS / "paper-base.yaml")
    cfg = load_config(path)
    cfg.cluster.num_engines = engines
    cfg.workload = dataclasses.replace(cfg.workload, duration_s=None, num_requests=60)
    layout = build_system(cfg, SimSettings(system=system))
    fast, plain = _both(cfg, layout, system, rate, 0)
    assert_same_results(fast, plain)
    assert fast.summary["fast_forward_cycles"] > 0


def test_a_policy_naming_no_exact_replay_runs_step_by_step(monkeypatch):
    """The fast path's one hook is the policy's `replay`: a policy that names none is simulated
    decision by decision (nothing replayed), with the same results."""
    from paraflex.engine.core.policies.full_batch_first import FullBatchFirst

    w = WorkloadConfig(arrival="lognormal", cv=2.0, num_requests=30, seed=5, output_scale=1.0)
    cfg = ring_config(0.05, "full-batch-first", 8, w)
    layout = ring_layout(cfg, "full-batch-first")
    monkeypatch.setattr(FullBatchFirst, "replay", None)
    fast, plain = _both(cfg, layout, "ring", 4.0, 5)
    assert_same_results(fast, plain)
    assert fast.summary["fast_forward_cycles"] == 0


# --- the bulk scheduler calls against the driving protocol ---------------------------------
def _pipeline(num_blocks=400):
    """Model m in two stages on two schedulers (engines 0 and 1), tokens_per_block 4."""
    scheds = []
    for e in range(2):
        s = EngineScheduler(BlockPool(num_blocks, 64), max_batch_size=4, engine_id=e)
        s.add_stage("m", e, 2, 16, 2)
        scheds.append(s)
    return scheds


def _start(scheds, prompts):
    """Prefill every prompt through both stages and return the first decode batch (formed)."""
    s0, s1 = scheds
    for i, (p, out) in enumerate(prompts):
        s0.add_request(f"r{i}", "m", p, out, float(i))
        b = s0.schedule(0.0)
        s0.complete(b)
        s1.receive_batch(b.message)
        b1 = s1.schedule(0.0)
        s0.receive_tokens(s1.complete(b1).token_message)
    return s0.schedule(1.0)


def _cycle(scheds, b0):
    """One round of the protocol: b0 through both stages, tokens back, next batch formed."""
    s0, s1 = scheds
    s0.complete(b0)
    s1.receive_batch(b0.message)
    b1 = s1.schedule(1.0)
    done = s1.complete(b1)
    assert not done.finished
    s0.receive_tokens(done.token_message)


def _state(scheds):
    out = []
    for s in scheds:
        reqs = sorted((r.req_id, r.state, r.context_len, r.generated, [list(x) for x in r.alloc.table]) for r in s.live_requests())
        out.append((reqs, s.decisions, s.requests.seq, s.first_stage.batch_seq, s.pool.num_free, s.pool.check(), s.check()))
    return out


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 9), st.integers(12, 20)), min_size=1, max_size=4), k=st.integers(1, 10))
def test_bulk_advance_equals_k_protocol_rounds(prompts, k):
    step, bulk = _pipeline(), _pipeline()
    b_step, b_bulk = _start(step, prompts), _start(bulk, prompts)
    for i in range(k):
        _cycle(step, b_step)
        if i < k - 1:
            b_step = step[0].schedule(1.0)
    bulk[0].bulk.advance_first_decode(b_bulk, k)
    bulk[1].bulk.advance_later_decode("m", 1, [r.req_id for r in b_bulk.requests], k)
    assert _state(bulk) == _state(step)
    nxt_step, nxt_bulk = step[0].schedule(2.0), bulk[0].schedule(2.0)
    assert (nxt_bulk.batch_id, [(r.req_id, r.start_pos, r.block_table) for r in nxt_bulk.requests]) == \
        (nxt_step.batch_id, [(r.req_id, r.start_pos, r.block_table) for r in nxt_step.requests])


def test_bulk_advance_refuses_a_request_that_is_not_running():
    scheds = _pipeline()
    b = _start(scheds, [(4, 16)])
    with pytest.raises(ProtocolError, match="not blocked"):
        scheds[1].bulk.advance_later_decode("m", 1, ["r0", "nope"], 2)
    scheds[0].complete(b)
    with pytest.raises(ProtocolError, match="not running"):
        scheds[0].bulk.advance_first_decode(b, 2)


@pytest.mark.slow
def test_parked_model_starvation_promotions_are_kept():
    """Two one-stage models on one engine: the older one's decodes repeat while the younger
    one's wait, until the starvation promotion serves it; the replay must stop for each one."""
    from paraflex.config.schema import Config
    from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef
    from paraflex.simulator.systems.layouts import SystemLayout
    from paraflex.simulator.workload import SimRequest

    cfg = Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "a", "arch": "tiny-2l"}, {"name": "b", "arch": "tiny-2l"}],
        "scheduler": {"max_batch_size": 8, "policy": "full-batch-first"},
    })
    layers = cfg.models[0].arch.num_layers
    models = {m: ModelPlacement(m, layers, [(0, layers)], [[0]]) for m in ("a", "b")}
    layout = SystemLayout("hand", Placement(1, "hand", {}, 0.0, models, [EnginePlacement(0, [StageRef("a", 0, 0), StageRef("b", 0, 0)], 0, {})]),
                          "full-batch-first", 1, cfg.cluster.memory_bytes)
    reqs = [SimRequest(0, "a", 0.0, 20, 400), SimRequest(1, "b", 1e-4, 30, 300), SimRequest(2, "a", 2e-4, 5, 200)]
    res = {ff: simulate(cfg, SimSettings(fast_forward=ff, check_invariants=True), layout=layout, requests=reqs)
           for ff in (True, False)}
    assert_same_results(res[True], res[False])
    promotions = [r.engines[0].scheduler.stats["starvation_promotions"] for r in res.values()]
    assert promotions[0] == promotions[1] > 0
    assert res[True].summary["fast_forward_cycles"] > 100


@settings(max_examples=200, deadline=None)
@given(others=st.lists(st.integers(0, 6), min_size=1, max_size=6), floor=st.integers(0, 8),
       gaps=st.lists(st.floats(0.0, 2.0), max_size=30), i=st.integers(0, 30), horizon=st.floats(0.0, 40.0))
def test_skippable_arrivals_are_water_filling(others, floor, gaps, i, horizon):
    """The horizon search's count of arrivals that provably go elsewhere equals sending them
    one by one to the least loaded replica away from the engines until it holds `floor`."""
    from heapq import heapify, heapreplace

    from paraflex.simulator.fastpath.fast_forward import skippable

    ts = [sum(gaps[:k + 1]) for k in range(len(gaps))]  # sorted, ties included
    i = min(i, len(ts))
    heap = list(others)
    heapify(heap)
    j = i
    while j < len(ts) and ts[j] < horizon and floor > heap[0]:
        heapreplace(heap, heap[0] + 1)
        j += 1
    assert skippable(list(others), floor, ts, i, horizon) == j - i


def test_ring_pipelines_across_nodes_identical_with_and_without_fast_forward():
    """Engine 0 alone on a node with a slow link to the node of engines 1, 2: the pipelines'
    hops take the link of the two engines they join, in both paths."""
    w = WorkloadConfig(arrival="lognormal", cv=2.0, num_requests=30, seed=5, output_scale=1.0)
    cfg = ring_config(0.05, "full-batch-first", 8, w, nodes=[1, 2], node_interconnect_gbps=0.1,
                      node_interconnect_latency_us=1000)
    fast, plain = _both(cfg, ring_layout(cfg, "full-batch-first"), "ring", 8.0, 5)
    assert_same_results(fast, plain)
    assert fast.summary["fast_forward_cycles"] > 0
