"""The served hop in the simulator (paraflex/costs/served_hop.py, simulator/core/cluster.py): a
profile's `served_hop` replaces the link's latency of every hop between engines of one node and
of every token message back to the first stage; its spread draws each one around it, the same
draws for the same seed; so does the engine loop's step spread for every stage execution."""

import pytest
from hand_placement import hand_placement

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.latency_spread import spread_of
from paraflex.costs.serving_terms import (ENGINE_LOOP_KEY, SERVED_HOP_KEY, EngineLoopTerm, ServedHopTerm, served_hop,
                                          store)
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import SystemLayout
from paraflex.simulator.workload import SimRequest

LINK_S = 0.0001  # the config's link between the two engines: 100 us, no bandwidth term to speak of


def _run(profile_dir=None, requests=None):
    cluster = {"num_engines": 2, "device": "cpu", "memory_gb": 1, "interconnect_latency_us": 1e6 * LINK_S,
               "interconnect_gbps": 1e6}
    if profile_dir:
        cluster["profile_dir"] = str(profile_dir)
    config = Config.from_dict({"cluster": cluster, "models": [{"name": "a", "arch": "tiny-2l"}],
                               "scheduler": {"max_batch_size": 8, "block_bytes": 4096}})
    placement = hand_placement({"a": (2, [(0, 1), (1, 2)], [[0, 1]])}, 2, 1 << 20)  # one layer per engine
    layout = SystemLayout("hand", placement, "full-batch-first", 1, config.cluster.memory_bytes)
    requests = requests or [SimRequest(0, "a", 0.0, 16, 11)]
    return simulate(config, SimSettings(), layout=layout, requests=requests, cost=CostModel("cpu")).metrics.requests


def test_every_hop_and_token_message_takes_the_served_latency(tmp_path):
    plain = _run()[0]
    store(str(tmp_path), SERVED_HOP_KEY, ServedHopTerm(0.002, 0.003, 10, 10))
    assert served_hop(str(tmp_path)) == ServedHopTerm(0.002, 0.003, 10, 10)
    served = _run(tmp_path)[0]
    assert served.first_token - plain.first_token == pytest.approx(0.002 - LINK_S, rel=0.01)  # one hop before it
    tbt = lambda r: (r.last_token - r.first_token) / (r.tokens - 1)  # noqa: E731
    # each later token: the token message back to stage 0, then the hop to stage 1
    assert tbt(served) - tbt(plain) == pytest.approx(0.002 + 0.003 - 2 * LINK_S, rel=0.01)


def test_the_spread_draws_hops_around_the_latency_and_a_seed_repeats_them(tmp_path):
    spread = spread_of([0.0, 2.0])  # 0 ... 2 x the latency, uniformly
    store(str(tmp_path), SERVED_HOP_KEY, ServedHopTerm(0.002, 0.003, 10, 10, spread, spread))
    requests = [SimRequest(i, "a", 0.5 * i, 16, 41) for i in range(8)]
    first, again = _run(tmp_path, requests), _run(tmp_path, requests)
    tbts = [(r.last_token - r.first_token) / (r.tokens - 1) for r in first.values()]
    assert [r.last_token for r in first.values()] == [r.last_token for r in again.values()]
    assert max(tbts) - min(tbts) > 0.0005  # the requests drew different hops
    store(str(tmp_path), SERVED_HOP_KEY, ServedHopTerm(0.002, 0.003, 10, 10))
    flat = [(r.last_token - r.first_token) / (r.tokens - 1) for r in _run(tmp_path, requests).values()]
    assert sum(tbts) / len(tbts) == pytest.approx(sum(flat) / len(flat), rel=0.1)  # the mean stays near the latency


def test_the_step_spread_draws_every_stage_execution_around_its_time(tmp_path):
    requests = [SimRequest(i, "a", 0.5 * i, 16, 41) for i in range(8)]
    plain = _run(requests=requests)
    store(str(tmp_path), ENGINE_LOOP_KEY, EngineLoopTerm([], 0.0, 0, "steps", {"decode": spread_of([0.5, 1.5])}))
    drawn, again = _run(tmp_path, requests), _run(tmp_path, requests)
    assert [r.last_token for r in drawn.values()] == [r.last_token for r in again.values()]
    tbt = lambda r: (r.last_token - r.first_token) / (r.tokens - 1)  # noqa: E731
    ratios = [tbt(drawn[i]) / tbt(plain[i]) for i in plain]
    assert max(ratios) - min(ratios) > 0.05 and 0.9 < sum(ratios) / len(ratios) < 1.1  # spread, the mean kept
    assert all(drawn[i].first_token == plain[i].first_token for i in plain)  # prefills: no spread given
