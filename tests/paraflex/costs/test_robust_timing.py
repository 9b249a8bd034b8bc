"""Statistics of timings on a shared machine (paraflex/costs/robust_timing.py), on synthetic
noisy data: other tenants add time, in stretches."""

import random

import pytest

from paraflex.costs.robust_timing import (fit_line, line_outliers, make_monotone, monotone_breaks, robust_time,
                                          spread)


def _noisy_rounds(true_s: float, rounds: int, per_round: int, busy_rounds: set, rng) -> list[list[float]]:
    """Runs that cost `true_s` plus a tenant's delay: small on most runs, large on every run of
    a busy round."""
    out = []
    for r in range(rounds):
        extra = 5 * true_s if r in busy_rounds else 0.0
        out.append([true_s + extra + rng.expovariate(1 / (0.2 * true_s)) for _ in range(per_round)])
    return out


def test_one_busy_round_does_not_move_the_median_of_round_minima_but_shows_in_the_spread():
    rng = random.Random(1)
    rounds = _noisy_rounds(0.010, 3, 8, {1}, rng)
    assert robust_time(rounds) == pytest.approx(0.010, rel=0.15)
    assert spread(rounds) > 3  # the busy round's minimum is ~6x the others
    quiet = _noisy_rounds(0.010, 3, 8, set(), rng)
    assert spread(quiet) < 0.3
    assert spread([[0.004, 0.005]]) == 0.0


def test_the_minimum_over_all_runs_alone_is_fooled_where_every_round_is_busy_only_the_spread_tells():
    rng = random.Random(2)
    rounds = _noisy_rounds(0.010, 3, 8, {0, 1, 2}, rng)
    assert robust_time(rounds) > 0.05  # nothing to recover: every round was held
    assert spread(rounds) < 0.3  # and the rounds agree: the profile cannot see it itself


def test_fit_line_ignores_one_inflated_point():
    xs, ys = [1, 2, 4, 8], [1.0 + 0.5 * x for x in [1, 2, 4, 8]]
    ys[2] += 50  # a busy machine stalled one measurement
    intercept, slope = fit_line(xs, ys)
    assert slope == pytest.approx(0.5) and intercept == pytest.approx(1.0, abs=0.6)
    assert fit_line([4], [3.0]) == (3.0, 0.0)


def test_line_outliers_finds_the_inflated_point_and_leaves_small_wobbles():
    xs = [16, 32, 64, 128]
    ys = [0.010 + 1e-4 * x for x in xs]
    assert line_outliers(xs, ys) == []
    wobbly = [y * f for y, f in zip(ys, [1.05, 0.97, 1.03, 1.0])]
    assert line_outliers(xs, wobbly) == []
    ys[1] += 0.050  # +56 ms, as one profile gave tiny-8l's prefill
    assert line_outliers(xs, ys) == [1]
    assert line_outliers([1, 8], [0.1, 0.001]) == []  # two points: a line fits them
    tiny = [1e-5, 2e-5, 9e-5]  # far off in share, but within the absolute floor
    assert line_outliers([1, 2, 3], tiny) == []


def test_monotone_breaks_names_both_points_of_a_pair_beyond_the_tolerance():
    assert monotone_breaks([1.0, 1.05, 1.02, 2.0]) == []  # 3% down: within 10%
    assert monotone_breaks([1.5, 1.0, 1.1, 2.0]) == [0, 1, 2]  # batch 1 costs more than 2 and 4
    assert monotone_breaks([1.0, 2.0, 3.0, 1.0]) == [1, 2, 3]


def test_make_monotone_pools_a_decreasing_run_into_its_mean_and_keeps_an_ordered_sequence():
    assert make_monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert make_monotone([3.0, 1.0, 2.0, 5.0]) == pytest.approx([2.0, 2.0, 2.0, 5.0])
    out = make_monotone([2.0, 1.0, 4.0, 3.0])
    assert out == pytest.approx([1.5, 1.5, 3.5, 3.5])
    rng = random.Random(3)
    ys = [rng.random() for _ in range(30)]
    fixed = make_monotone(ys)
    assert all(a <= b + 1e-12 for a, b in zip(fixed, fixed[1:]))
    assert sum(fixed) == pytest.approx(sum(ys))  # pooling keeps the mass
