"""Alg. 2 + Alg. 1 on hand-built problems, and property tests of constraints (4)-(6) and P1."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraflex.planner.drf import min_level
from paraflex.planner.placement_optimizer import optimize
from paraflex.planner.replica_placer import ReplicaPlacer
from paraflex.planner.problem import ModelSpec, NoFeasiblePlan, Problem, UniformLayers


def _model(name, layers, stages, rate, layer_bytes=10, ends=0):
    return ModelSpec.from_arch(name, layers, stages, rate, UniformLayers(layer_bytes, ends, ends))


def check(problem: Problem, sol) -> None:
    """Every constraint of §4.2 on a solution; returns nothing, asserts everything."""
    n = problem.num_engines
    cap = [problem.memory_bytes] * n
    cnt = [0] * n
    for m, reps in zip(problem.models, sol.replicas):
        assert reps, f"{m.name} has no replica"
        used = set()
        for rep in reps:
            assert len(rep) == m.num_stages
            for k in range(1, len(rep)):  # P1: consecutive ascending (mod n on a ring)
                step = (rep[k] - rep[k - 1]) % n if problem.ring else rep[k] - rep[k - 1]
                assert step == 1, rep
            assert not used & set(rep), "(4) replicas overlap"
            used |= set(rep)
            for k, e in enumerate(rep):
                cap[e] -= m.stage_weights[k]
                cnt[e] += 1
    assert all(c >= 0 for c in cap), "(5) memory"
    phi = min_level(cap, cnt)
    assert phi >= problem.kappa_bytes, "(6) kappa"
    assert sol.objective_bytes == pytest.approx(phi)


def test_single_stage_model_goes_to_lowest_engine_on_ties():
    problem = Problem((_model("a", 4, 1, 1.0),), 4, 100, kappa_bytes=50)
    sol = optimize(problem)
    # one replica per engine until Alg. 1 runs out of engines; ties resolved to the lowest engine
    assert sol.replicas == [[[0], [1], [2], [3]]]
    check(problem, sol)


def test_first_placement_prefers_empty_engines():
    big = _model("big", 8, 4, 1.0)
    small = _model("small", 2, 1, 1e-6)  # negligible demand: never replicated
    problem = Problem((big, small), 6, 100, kappa_bytes=55)
    sol = optimize(problem, fill=False)  # the paper's rule: replication stops with big
    # big (4 stages) is placed first at 0-3; small goes to the first empty engine, 4
    assert sol.replicas[0][0] == [0, 1, 2, 3]
    assert sol.replicas[1] == [[4]]
    check(problem, sol)


def test_stops_before_kappa_breaks_and_keeps_last_feasible_plan():
    # each engine holds 100 bytes; a stage weighs 20; kappa 30 allows at most 2 stages per engine
    problem = Problem((_model("a", 2, 1, 1.0, layer_bytes=10),), 2, 100, kappa_bytes=30)
    sol = optimize(problem)
    assert sorted(sol.replicas[0]) == [[0], [1]]  # the chosen model has no more engines
    tight = Problem((_model("a", 4, 2, 1.0), _model("b", 4, 2, 1.0)), 2, 100, kappa_bytes=30)
    sol = optimize(tight, fill=False)
    assert "kappa" in sol.stop_reason or "Alg. 1" in sol.stop_reason
    check(tight, sol)
    sol = optimize(tight)
    assert "no model can get another replica" in sol.stop_reason
    check(tight, sol)


def test_no_feasible_plan_names_the_model_and_the_fix():
    # fits the cluster in total (150 + 10 <= 200) but its single stage exceeds one engine
    problem = Problem((_model("huge", 3, 1, 1.0, layer_bytes=50),), 2, 100, kappa_bytes=10)
    with pytest.raises(NoFeasiblePlan, match="huge.*kappa_gb"):
        optimize(problem)


def test_total_capacity_check_fails_fast():
    problem = Problem((_model("a", 4, 2, 1.0, layer_bytes=45), _model("b", 4, 2, 1.0, layer_bytes=45)), 4, 100, kappa_bytes=20)
    with pytest.raises(NoFeasiblePlan, match="more than the cluster"):
        optimize(problem)  # weights 360 + kappa 4 x 20 > 4 x 100


def test_ring_wraps_in_the_same_direction():
    # engine 1 is nearly full: a 3-stage replica avoids it only as 2 -> 3 -> 0, which needs the ring
    cap = np.array([100.0, 5.0, 100.0, 100.0])
    cnt = np.array([0, 1, 0, 0])
    weights = np.array([10.0, 10.0, 10.0])
    taken = np.zeros(4, dtype=bool)
    model = _model("m", 3, 3, 1.0)
    ring = ReplicaPlacer(Problem((model,), 4, 100, ring=True))
    line = ReplicaPlacer(Problem((model,), 4, 100, ring=False))
    assert ring.best_start(cap, cnt, taken, weights) == (2, 5.0)  # engine 1 keeps its level 5/1
    start, phi = line.best_start(cap, cnt, taken, weights)
    assert start == 0 and phi < 0  # every window on a line crosses engine 1 and overflows it
    assert ring.windows(3)[2].tolist() == [2, 3, 0]


def test_demand_proportional_replication():
    hot = _model("hot", 2, 1, 3.0)
    cold = _model("cold", 2, 1, 1.0)
    problem = Problem((hot, cold), 8, 1000, kappa_bytes=10)
    sol = optimize(problem, fill=False)  # the paper's rule stops both when hot has no engine left
    hot_r, cold_r = len(sol.replicas[0]), len(sol.replicas[1])
    assert hot_r == 8  # Alg. 1 stopped because hot would need a 9th engine
    assert abs(hot_r - 3 * cold_r) <= 3  # 3:1 demand, within one replica of cold
    check(problem, sol)


def test_fill_keeps_replicating_the_others_when_the_chosen_model_is_full():
    """The base case under balanced popularity: a 3-stage model's third replica needs 9 of 8
    engines. The paper's rule stops every model there (four engines hold one stage each, the
    others two); with fill the one-stage models go on while an engine holds fewer stages than
    the busiest one then did."""
    big = _model("big", 9, 3, 1.0)
    smalls = tuple(_model(f"s{i}", 2, 1, 1.0) for i in range(3))
    problem = Problem((*smalls, big), 8, 1000, kappa_bytes=10)
    paper = optimize(problem, fill=False)
    assert [len(r) for r in paper.replicas] == [2, 2, 2, 2]
    assert "Alg. 1" in paper.stop_reason and "hold no stage" not in paper.stop_reason
    filled = optimize(problem)
    assert [len(r) for r in filled.replicas] == [4, 3, 3, 2]
    per_engine = [sum(e in rep for reps in filled.replicas for rep in reps) for e in range(8)]
    assert per_engine == [2] * 8  # spare engines filled, none above the busiest one's 2
    assert "big: 3 replicas x 3 stages would exceed the 8 engines" in filled.stop_reason
    assert "s0: no spare engine" in filled.stop_reason
    check(problem, filled)


def test_fill_goes_on_after_a_model_fails_kappa():
    """b (2 stages of 40) fills engines 0-1; its second replica would share engine 2 with a and
    leave 25 < kappa 30 there. The paper's rule stops; with fill, a gets engine 3."""
    b = _model("b", 4, 2, 5.0, layer_bytes=20)
    a = _model("a", 2, 1, 1.0, layer_bytes=5)
    problem = Problem((a, b), 4, 100, kappa_bytes=30)
    paper = optimize(problem, fill=False)
    filled = optimize(problem)
    assert [len(r) for r in paper.replicas] == [1, 1]
    assert "below kappa" in paper.stop_reason and "engine 3 holds no stage" in paper.stop_reason
    assert [len(r) for r in filled.replicas] == [2, 1]
    assert "b: replica" in filled.stop_reason and "below kappa" in filled.stop_reason
    assert "holds no stage" not in filled.stop_reason
    check(problem, filled)


def test_an_empty_engine_is_explained():
    """One 3-stage model on 4 engines: engine 3 can hold nothing; the stop reason says so."""
    problem = Problem((_model("m", 3, 3, 1.0),), 4, 100, kappa_bytes=10)
    for fill in (True, False):
        sol = optimize(problem, fill=fill)
        assert sol.replicas == [[[0, 1, 2]]]
        assert "engine 3 holds no stage" in sol.stop_reason


def test_no_feasible_plan_points_to_smaller_stages_and_gib():
    """Packing fails (each stage fits an engine alone): the fix is more, smaller stages, and
    sizes are in GiB as configured."""
    gib = 2**30
    models = tuple(_model(name, 1, 1, 1.0, layer_bytes=55 * gib) for name in "abc")
    problem = Problem(models, 2, 100 * gib, kappa_bytes=6 * gib)  # 183 GiB of 200 in all
    with pytest.raises(NoFeasiblePlan) as info:
        optimize(problem)
    msg = str(info.value)
    assert "lower planner.target_stage_time" in msg and "raise planner.target_stage_time" not in msg
    assert "kappa = 6 GiB" in msg and "100 GiB per engine" in msg and " GB" not in msg


@st.composite
def problems(draw, max_engines=12, max_models=5):
    n = draw(st.integers(2, max_engines))
    models = []
    for i in range(draw(st.integers(1, max_models))):
        s = draw(st.integers(1, min(4, n)))
        layers = s * draw(st.integers(1, 4)) + draw(st.integers(0, s - 1))
        models.append(_model(f"m{i}", layers, s, draw(st.floats(0.1, 5.0)), draw(st.integers(1, 12)), draw(st.integers(0, 6))))
    memory = draw(st.integers(60, 200))
    return Problem(tuple(models), n, memory, kappa_bytes=draw(st.integers(0, 30)), ring=draw(st.booleans()))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_plan_satisfies_the_constraints(problem):
    try:
        sol = optimize(problem)
    except NoFeasiblePlan:
        return
    check(problem, sol)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_polish_never_lowers_phi(problem):
    try:
        raw = optimize(problem, polish=False)
    except NoFeasiblePlan:
        return
    polished = optimize(problem)
    assert polished.objective_bytes >= raw.objective_bytes * (1 - 1e-9)
    check(problem, polished)


def test_work_shares_put_one_small_model_beside_each_large_stage():
    """dispersion-4x cut at T_s x2 (llama-80b 2 x 120 layers, llama-20b 1 x 60 layers, equal
    rates): by work every engine holds one stage of the large model and one small replica;
    eq. 7 (`work_shares=False`) gives the small models four replicas, three stages per engine."""
    big = _model("big", 240, 2, 1.0, ends=5)
    smalls = tuple(_model(f"s{i}", 60, 1, 1.0, ends=5) for i in range(4))
    for work, small_replicas, per_engine in ((True, 2, 2), (False, 4, 3)):
        problem = Problem((big, *smalls), 8, 10_000, kappa_bytes=10, work_shares=work)
        sol = optimize(problem)
        assert [len(r) for r in sol.replicas] == [4] + [small_replicas] * 4
        assert [sum(e in rep for reps in sol.replicas for rep in reps) for e in range(8)] == [per_engine] * 8
        check(problem, sol)
