"""How a served latency spreads around its fitted value (paraflex/costs/latency_spread.py): the
quantiles kept, the ratio drawn at a quantile, and what an empty spread means."""

import pytest

from paraflex.costs.latency_spread import SPREAD_POINTS, spread_of, spread_ratio


def test_the_spread_is_the_samples_quantiles_every_percent():
    ratios = [i / 100 for i in range(201)]  # 0, 0.01, ..., 2.0
    spread = spread_of(list(reversed(ratios)))
    assert len(spread) == SPREAD_POINTS
    assert spread[0] == 0.0 and spread[50] == pytest.approx(1.0) and spread[99] == pytest.approx(1.98)
    assert spread[-1] == pytest.approx(2.0)


def test_the_logged_p99_is_drawn_at_the_99th_percentile_not_pulled_to_a_one_off():
    ratios = [1.0] * 399 + [40.0]  # one sample in 400 a one-off
    assert spread_ratio(spread_of(ratios), 0.99) == pytest.approx(1.0)


def test_a_sample_below_zero_counts_as_zero():
    assert spread_of([-0.5, 1.0, 2.0])[0] == 0.0


def test_the_ratio_interpolates_between_quantiles():
    spread = spread_of([0.0, 2.0])  # 0 ... 2 linearly
    assert spread_ratio(spread, 0.25) == pytest.approx(0.5) and spread_ratio(spread, 0.999) == pytest.approx(1.998)


def test_an_empty_spread_or_no_draw_is_the_fitted_latency():
    assert spread_of([]) == [] and spread_ratio([], 0.3) == 1.0 and spread_ratio([0.5, 1.5], None) == 1.0
