"""The shared host CPU in the simulator (paraflex/costs/host_cpu.py, simulator/core/cluster.py):
engines of a `device: cpu` cluster processor-share its cores, so a step stretches with the
other engines busy before it; one engine alone and GPU clusters are unchanged, and the run is the
same with and without the fast path (which steps aside)."""

import pytest
from hand_placement import hand_placement
from sim_cases import assert_same_results

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.host_cpu import HOST_CPU_KEY, HostCpu
from paraflex.costs.serving_terms import GATEWAY_KEY, GatewayTerm, host_cpu, store
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import SystemLayout
from paraflex.simulator.workload import SimRequest


def _config(device="cpu", profile_dir=None) -> Config:
    cluster = {"num_engines": 2, "device": device, "memory_gb": 1}
    if profile_dir:
        cluster["profile_dir"] = str(profile_dir)
    return Config.from_dict({"cluster": cluster, "models": [{"name": "a", "arch": "tiny-2l"}, {"name": "b", "arch": "tiny-2l"}],
                             "scheduler": {"max_batch_size": 8, "block_bytes": 4096}})


def _run(config, requests, fast_forward=True):
    layers = config.models[0].arch.num_layers
    placement = hand_placement({"a": (layers, [(0, layers)], [[0]]), "b": (layers, [(0, layers)], [[1]])}, 2, 1 << 20)
    layout = SystemLayout("hand", placement, "full-batch-first", 1, config.cluster.memory_bytes)
    cost = CostModel(config.cluster.device)  # the roofline: the test profile has no op tables
    return simulate(config, SimSettings(fast_forward=fast_forward), layout=layout,
                    requests=requests, cost=cost)


def _mean_tbt(result, rid):
    r = result.metrics.requests[rid]
    return (r.last_token - r.first_token) / (r.tokens - 1)


@pytest.fixture
def one_core(tmp_path):
    """A profile whose host has one core and each busy engine needs one."""
    store(str(tmp_path), HOST_CPU_KEY, HostCpu(cores=1, demand_per_engine=1.0))
    return tmp_path


def test_two_busy_engines_on_one_core_take_twice_as_long_per_step(one_core):
    both = [SimRequest(0, "a", 0.0, 16, 400), SimRequest(1, "b", 0.0, 16, 400)]
    plain, shared = _run(_config(), both), _run(_config(profile_dir=one_core), both)
    for rid in (0, 1):  # every step after the first window of 20 ms sees the other engine busy throughout
        assert _mean_tbt(shared, rid) == pytest.approx(2 * _mean_tbt(plain, rid), rel=0.02)
    assert shared.summary["fast_forward_cycles"] == 0 < plain.summary["fast_forward_cycles"]


def test_one_engine_alone_is_unchanged(one_core):
    alone = [SimRequest(0, "a", 0.0, 16, 100), SimRequest(1, "b", 5.0, 16, 100)]  # never at the same time
    plain, shared = _run(_config(), alone), _run(_config(profile_dir=one_core), alone)
    assert list(shared.metrics.request_rows()) == list(plain.metrics.request_rows())


def test_a_gpu_cluster_has_no_shared_host(one_core):
    config = _config("a100", one_core)
    assert host_cpu(config.cluster) is None and host_cpu(_config(profile_dir=one_core).cluster) == HostCpu(1, 1.0)
    both = [SimRequest(0, "a", 0.0, 16, 50), SimRequest(1, "b", 0.0, 16, 50)]
    assert list(_run(config, both).metrics.request_rows()) == list(_run(_config("a100"), both).metrics.request_rows())


def test_the_fast_path_steps_aside_and_gives_the_same_results(one_core):
    requests = [SimRequest(i, "ab"[i % 2], 0.003 * i, 8 + i, 20 + 3 * i) for i in range(12)]
    config = _config(profile_dir=one_core)
    assert_same_results(_run(config, requests, fast_forward=True), _run(config, requests, fast_forward=False))


def _ttfts(profile_dir, quiet_delay_s, requests, device="cpu"):
    store(str(profile_dir), GATEWAY_KEY, GatewayTerm(0.05, 9, quiet_delay_s=quiet_delay_s))
    records = _run(_config(device, profile_dir), requests).metrics.requests
    return {rid: r.first_token - r.arrival for rid, r in records.items()}


def test_the_gateway_delay_is_its_quiet_latency_stretched_at_each_arrival(one_core):
    """One core, one core's worth per busy engine: a request arriving while both engines run
    waits twice the gateway's quiet latency, one arriving on an idle host once; a GPU cluster
    (no host term) keeps the median delay for every request."""
    requests = [SimRequest(0, "a", 0.0, 16, 400), SimRequest(1, "b", 0.0, 16, 400),
                SimRequest(2, "a", 0.2, 16, 4), SimRequest(3, "b", 5.0, 16, 4)]
    slow, none = _ttfts(one_core, 0.01, requests), _ttfts(one_core, 0.0, requests)
    assert slow[0] - none[0] == pytest.approx(0.01, abs=1e-6)  # both engines idle before t=0
    assert slow[2] - none[2] == pytest.approx(0.02, abs=2e-3)  # both engines busy: x2 (to a step's end)
    assert slow[3] - none[3] == pytest.approx(0.01, abs=1e-6)  # the host quiet again
    gpu, plain = _ttfts(one_core, 0.01, requests, device="a100"), _run(_config("a100"), requests).metrics.requests[3]
    assert gpu[3] - (plain.first_token - plain.arrival) == pytest.approx(0.05)
