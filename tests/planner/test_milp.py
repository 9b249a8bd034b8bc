"""Exact solver: optimum on tiny instances, never below the heuristic for the same replicas."""

import random

import numpy as np
import pytest

from paraflex.planner import milp
from paraflex.planner.placement_optimizer import optimize
from paraflex.planner.replica_placer import ReplicaPlacer
from paraflex.planner.problem import ModelSpec, NoFeasiblePlan, Problem, UniformLayers


def _model(name, layers, stages, rate, layer_bytes=10, ends=5):
    return ModelSpec.from_arch(name, layers, stages, rate, UniformLayers(layer_bytes, ends, ends))


def _fragmenting_problem():
    # stage bytes: big 25/20/20/25 (embedding and head on the ends), a and b 25/25; 200 per engine
    return Problem((_model("big", 8, 4, 1.0), _model("a", 4, 2, 2.5), _model("b", 4, 2, 2.2)), 8, 200, kappa_bytes=20)


def test_optimum_by_pigeonhole():
    problem = _fragmenting_problem()
    # 2x4 + 3x2 + 3x2 = 20 stages on 8 engines: some engine holds 3; the best such engine holds
    # a 20-byte middle stage of big and two 25-byte stages: (200 - 70) / 3
    engines, phi, proven = milp.solve_placement(problem, [2, 3, 3])
    assert proven
    assert phi == pytest.approx(130 / 3)


def test_greedy_step_fragments_where_the_optimum_does_not():
    # Alg. 2's plain greedy for (2, 3, 3): a's replicas take the roomiest engine pairs and leave
    # one engine with three 25-byte stages, (200 - 75) / 3 below the optimum (200 - 70) / 3
    problem = _fragmenting_problem()
    placer = ReplicaPlacer(problem)
    cap, cnt = np.full(8, 200.0), np.zeros(8, dtype=np.int64)
    for model, count in zip(problem.models, [2, 3, 3]):
        weights = np.asarray(model.stage_weights, dtype=float)
        starts = []
        for _ in range(count):
            start, _ = placer.best_start(cap, cnt, placer.taken(starts, model.num_stages), weights)
            cap[placer.windows(model.num_stages)[start]] -= weights
            cnt[placer.windows(model.num_stages)[start]] += 1
            starts.append(start)
    assert (cap / cnt).min() == pytest.approx(125 / 3)


def test_heuristic_follows_the_exact_schedule_on_the_fragmenting_example():
    # with its retries the heuristic replicates as far as the exact schedule and matches it
    problem = _fragmenting_problem()
    exact, heuristic = milp.solve(problem), optimize(problem)
    assert [len(r) for r in heuristic.replicas] == [len(r) for r in exact.replicas] == [2, 4, 4]
    assert heuristic.objective_bytes == pytest.approx(exact.objective_bytes)


def test_infeasible_replica_counts_return_none():
    problem = Problem((_model("a", 4, 2, 1.0, layer_bytes=40),), 2, 100, kappa_bytes=10)
    assert milp.solve_placement(problem, [1]) is not None
    assert milp.solve_placement(problem, [2]) is None  # two replicas of 2 stages on 2 engines overlap


def test_solve_follows_alg1_and_raises_when_nothing_fits():
    with pytest.raises(NoFeasiblePlan):
        milp.solve(Problem((_model("a", 4, 2, 1.0, layer_bytes=60),), 2, 100, kappa_bytes=10))
    problem = Problem((_model("a", 2, 1, 3.0), _model("b", 2, 1, 1.0)), 4, 200, kappa_bytes=10)
    sol = milp.solve(problem, fill=False)
    assert sol.optimal
    # Alg. 1: 3:1 demand -> (3, 1), tie goes to the larger target -> (4, 1), then b -> (4, 2); a 5th a does not fit
    assert [len(r) for r in sol.replicas] == [4, 2]
    # fill: b goes on while it fits, as in the heuristic
    assert [len(r) for r in milp.solve(problem).replicas] == [4, 4]


@pytest.mark.parametrize("seed", range(8))
def test_heuristic_never_above_optimum_on_tiny_instances(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    models = tuple(
        _model(f"m{i}", 6, s, rng.uniform(0.5, 2.0), rng.randint(4, 10), rng.randint(0, 4))
        for i, s in enumerate(rng.choice([1, 2, 3]) for _ in range(rng.randint(2, 3)))
    )
    problem = Problem(models, n, rng.randint(80, 160), kappa_bytes=rng.randint(0, 15), ring=rng.random() < 0.5)
    try:
        heuristic = optimize(problem)
    except NoFeasiblePlan:
        assert milp.solve_placement(problem, [1] * len(models)) is None  # never fails where a plan exists
        return
    found = milp.solve_placement(problem, [len(r) for r in heuristic.replicas])
    assert found is not None
    assert heuristic.objective_bytes <= found[1] * (1 + 1e-6)
