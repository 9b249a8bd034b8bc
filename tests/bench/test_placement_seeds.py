"""bench/placement_seeds.py: the expected engine loads follow the placement (their total does
not), the variance split and the within-seed correlation do their arithmetic, the most and least
compute-balanced same-order placements bracket the planner's with its memory objective kept, and
one short point simulates both placements on the same requests."""

from __future__ import annotations

import numpy as np
import pytest
from repo_paths import CONFIGS, load_bench

BASE = str(CONFIGS / "paper-base.yaml")


@pytest.fixture(scope="module")
def bench():
    return load_bench("placement_seeds")


def test_engine_loads_move_with_the_placement_and_keep_their_total(bench):
    config = bench.point_config(BASE, "balanced", duration=3.0, trace=None)
    ours = bench.layout_of(config, bench.PLANNER).placement
    drawn = bench.layout_of(config, "random 1").placement
    a, b = bench.engine_loads(config, ours), bench.engine_loads(config, drawn)
    assert a.sum() == pytest.approx(b.sum())
    assert not np.allclose(np.sort(a), np.sort(b))  # the draw pairs other stages on its engines
    cost = config.cluster.cost_model()
    per_stage = bench.stage_loads(config, ours)
    for m in config.models:  # a model's replicas together carry its rate share x its reference time
        total = per_stage[m.name].sum() * ours.models[m.name].num_replicas
        assert total == pytest.approx(cost.model_time(m.arch) / len(config.models))
    assert bench.balance(np.array([1.0, 1.0, 2.0, 0.0])) == (2.0, pytest.approx(np.sqrt(0.5)))
    paper = bench.engine_loads(config, bench.layout_of(config, bench.MEMORY_ONLY).placement)
    assert bench.balance(a)[1] < bench.balance(paper)[1]  # the planner's compute balance, against Alg. 2 alone


def test_variance_split_separates_rows_columns_and_interaction(bench):
    rows, cols = np.array([0.0, 1.0, 2.0]), np.array([10.0, 20.0])
    additive = rows[:, None] + cols[None, :]
    sd_p, sd_w, sd_i = bench.variance_split(additive)
    assert (sd_p, sd_w, sd_i) == (pytest.approx(1.0), pytest.approx(np.std(cols, ddof=1)), pytest.approx(0.0))
    checker = np.array([[1.0, -1.0], [-1.0, 1.0]])
    sd_p, sd_w, sd_i = bench.variance_split(checker)
    assert sd_p == pytest.approx(0.0) and sd_w == pytest.approx(0.0) and sd_i > 1.0


def test_within_seed_correlation_ignores_the_seeds_own_level(bench):
    x = np.array([[0.1, 0.1], [0.2, 0.2], [0.3, 0.3]])  # one value per placement, every seed
    y = np.array([[30.0, 20.0], [29.0, 19.0], [28.0, 18.0]])  # seed 2 is 10 req/s lower throughout
    assert bench.within_seed_correlation(x, y) == pytest.approx(-1.0)
    assert np.isnan(bench.within_seed_correlation(x, np.full_like(y, 5.0)))


@pytest.mark.parametrize("popularity", ["balanced", "1.01"])
def test_balance_extremes_bracket_the_planner_and_keep_its_memory_objective(bench, popularity):
    config = bench.point_config(BASE, popularity, duration=3.0, trace=None)
    ours = bench.layout_of(config, bench.PLANNER).placement
    extremes, count = bench.balance_extremes(config, ours)
    assert count >= 1 and set(extremes) == set(bench.EXTREMES)
    shape = {}
    for label in bench.EXTREMES:
        placed = bench.layout_of(config, label).placement
        assert placed.objective >= ours.objective * (1 - 1e-9)  # Phi* no lower than the planner's
        for name, m in placed.models.items():  # same cuts and replica counts, stages in order on consecutive engines
            assert m.stages == ours.models[name].stages and m.num_replicas == ours.models[name].num_replicas
            assert all(r == list(range(r[0], r[0] + len(r))) for r in m.replicas)
        shape[label] = bench.balance(bench.engine_loads(config, placed))
    planner = bench.balance(bench.engine_loads(config, ours))
    assert shape["most balanced"][0] <= planner[0] + 1e-9 and shape["most balanced"][1] <= planner[1] + 1e-9
    assert shape["least balanced"][1] >= planner[1] - 1e-9


def test_one_point_simulates_both_placements_on_the_same_requests(bench):
    common = dict(config_path=BASE, popularity="balanced", duration=2.0, trace=None, rate=16.0, workload_seed=3)
    ours = bench.run_point(bench.Point(placement=bench.PLANNER, **common))
    drawn = bench.run_point(bench.Point(placement="random 0", **common))
    assert ours["throughput_rps"] > 0 and drawn["throughput_rps"] > 0
    assert (ours["placement"], drawn["placement"]) == (bench.PLANNER, "random 0")
    lines = bench.report(bench.point_config(BASE, "balanced", 2.0, None), [ours, drawn], [0], [3])
    assert lines[2].startswith("| 3 | ") and "paraflex / random" in lines[4]
