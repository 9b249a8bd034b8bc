"""The seed systems' decision rules on hand-checkable cases: Aegaeon's WRR quota (the paper's
worked example) and grouped FCFS, Prism's KVPR placement and Moore-Hodgson order, MuxServe's
placement limit, the switch and activation costs."""

from __future__ import annotations

import pytest

from paraflex.errors import UserError
from paraflex.simulator.seeds.grouped_fcfs import GroupedFCFS
from paraflex.simulator.seeds.kvpr import PlacedModel, kvpr_placement
from paraflex.simulator.seeds.moore_hodgson import moore_hodgson
from paraflex.simulator.seeds.muxserve_placement import muxserve_placement
from paraflex.simulator.seeds.switching import aegaeon_switch_time, prism_activation_time
from paraflex.simulator.seeds.wrr_quota import wrr_quotas

GB = 2**30


def test_wrr_quota_paper_worked_example():
    # Aegaeon §4.3: three batches, d = 0.1, t = 0.025, c = 3, Q_MAX = 3 -> n = 4, alpha = 1, q = 3 s
    alpha, q = wrr_quotas([0.1] * 3, [0.025] * 3, 3.0, q_max=3.0)
    assert alpha == pytest.approx(1.0)
    assert q == pytest.approx([3.0, 3.0, 3.0])
    # 3 s of 25 ms steps = 120 tokens; the round lasts 3 x 3 + 3 = 12 s = 120 x 0.1 s: on time
    assert q[0] / 0.025 == pytest.approx(120) and 3 * q[0] + 3.0 == pytest.approx(120 * 0.1)


def test_wrr_quota_floor_and_single_model():
    alpha, q = wrr_quotas([0.1], [0.001], 0.5, q_max=4.0)  # light load: alpha held at 0.5
    assert alpha == 0.5
    assert q == pytest.approx([0.5 / (100 * (0.5 - 0.01))])
    assert wrr_quotas([0.1, 0.1], [0.02, 0.03], 0.0, q_max=4.0)[1] == [4.0, 4.0]  # no switch: Q_MAX
    # the slowest batch (smallest n) gets the largest quota, never above Q_MAX
    _, q = wrr_quotas([0.1, 0.1], [0.01, 0.05], 1.0, q_max=4.0)
    assert q[1] > q[0] and max(q) <= 4.0 + 1e-9


def test_grouped_fcfs_joins_then_opens_on_least_loaded():
    fcfs = GroupedFCFS(2, exec_time=lambda r: 1.0, switch_time=lambda m: 0.5, max_group=2)
    active = [None, None]
    assert fcfs.dispatch("r1", "A", active) == (0, False)  # both empty: instance 0
    assert fcfs.dispatch("r2", "A", active) == (0, True)  # joins A's group
    assert fcfs.dispatch("r3", "A", active) == (1, False)  # group full (2): opens one on the idle instance
    assert fcfs.dispatch("r4", "B", active) == (1, False)  # loads 0: 0.5 + 2, 1: 0.5 + 1 -> instance 1
    assert [g.model for g in fcfs.queues[1]] == ["A", "B"]
    assert fcfs.next_request(0) == ("A", "r1")
    # the size is cumulative: r1 ran, but A's group on 0 takes no third request
    assert fcfs.dispatch("r5", "A", active) == (1, True)  # joins A's group on instance 1 (size 1 < 2)
    assert fcfs.next_model_after(1, "A") == "B"


def test_kvpr_places_by_pressure_and_tau_keeps_current():
    models = [PlacedModel("hot", 4.0, 1.0, 10 * GB), PlacedModel("warm", 2.0, 1.0, 10 * GB),
              PlacedModel("cold", 1.0, 1.0, 10 * GB), PlacedModel("tail", 0.5, 2.0, 10 * GB)]
    got = kvpr_placement(models, 2, 80 * GB)
    # hot -> 0 (tie, lowest id); warm -> 1 (0/80 < 4/70); cold -> 1 (2/70 < 4/70); tail -> 1 (3/60 < 4/70)
    assert got == {"hot": 0, "warm": 1, "cold": 1, "tail": 1}
    # a model already on GPU 0 stays there when the gain is within tau, moves beyond it
    assert kvpr_placement(models[:2], 2, 80 * GB, tau=1.0, current={"warm": 0})["warm"] == 0
    assert kvpr_placement(models[:2], 2, 80 * GB, tau=0.0, current={"warm": 0})["warm"] == 1


def test_kvpr_leaves_models_that_fit_nowhere_unplaced():
    models = [PlacedModel(f"m{i}", 1.0, 1.0, 30 * GB) for i in range(3)]
    got = kvpr_placement(models, 1, 80 * GB, min_kv_bytes=10 * GB)
    assert got == {"m0": 0, "m1": 0, "m2": None}


def test_moore_hodgson_drops_the_longest_job_to_keep_more_on_time():
    # (name, deadline, exec): EDD order a, b, c; a + b + c = 7 > c's deadline 6 -> drop b (longest)
    jobs = [("c", 6.0, 1.0), ("a", 2.0, 2.0), ("b", 5.0, 4.0)]
    sched, late = moore_hodgson(jobs, 0.0, lambda j: j[1], lambda j: j[2])
    assert [j[0] for j in sched] == ["a", "c"] and [j[0] for j in late] == ["b"]
    # all on time: plain earliest-deadline order, nothing dropped
    sched, late = moore_hodgson(jobs, -10.0, lambda j: j[1], lambda j: j[2])
    assert [j[0] for j in sched] == ["a", "b", "c"] and late == []


def test_muxserve_at_most_two_models_per_engine():
    models = [PlacedModel(f"m{i}", 1.0 + i, 10.0, 10 * GB) for i in range(4)]
    got = muxserve_placement(models, 2, 80 * GB, {})
    assert sorted(got.values()) == [0, 0, 1, 1]
    with pytest.raises(UserError, match="at most 2 per engine"):
        muxserve_placement(models + [PlacedModel("m4", 1.0, 10.0, GB)], 2, 80 * GB, {})
    with pytest.raises(UserError, match="fits on no engine"):
        muxserve_placement(models[:2], 2, 15 * GB, {"m0": 10 * GB, "m1": 10 * GB})


def test_switch_and_activation_costs():
    # Eq. 4: 26 GB over 32 GB/s, x 0.625
    assert aegaeon_switch_time(26e9, 32e9) == pytest.approx(26 / 32 * 0.625)
    # Prism Fig. 9: 8B 0.7 s, 14B 1.3 s, 70B 1.5 s; 1B as fast as 8B; 11B halfway
    assert prism_activation_time(1e9) == 0.7 and prism_activation_time(8e9) == 0.7
    assert prism_activation_time(11e9) == pytest.approx(1.0)
    assert prism_activation_time(14e9) == pytest.approx(1.3) and prism_activation_time(70e9) == pytest.approx(1.5)
