"""The re-planning controller: the rate meter, the interval and threshold triggers, no clock."""

import pytest

from paraflex.config.schema import Config
from paraflex.errors import UserError
from paraflex.planner.api import plan
from paraflex.planner.replan_controller import RateMeter, ReplanController


def _config() -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": 4, "device": "a100-80g", "tp": 1, "memory_gb": 48},
        "models": [{"name": "a", "arch": "llama-20b", "rate": 3}, {"name": "b", "arch": "llama-20b", "rate": 1}],
        "planner": {"kappa_gb": 1},
    })


def _feed(controller, rates: dict, t0: float, t1: float) -> None:
    """Evenly spaced arrivals at `rates` (req/s) over [t0, t1)."""
    for model, rate in rates.items():
        n = int(round(rate * (t1 - t0)))
        for k in range(n):
            controller.observe(model, t0 + (k + 0.5) * (t1 - t0) / n)


def test_rate_meter_counts_the_sliding_window():
    meter = RateMeter(10.0, ["a", "b"])
    for t in range(30):
        meter.observe("a", t + 0.5)
    assert meter.rates(30.0) == {"a": 1.0, "b": 0.0}
    assert meter.rates(35.0)["a"] == pytest.approx(0.5)
    assert meter.rates(50.0)["a"] == 0.0


def test_interval_replans_and_a_shift_moves_replicas():
    config = _config()
    ctl = ReplanController(config, plan(config), interval=60.0, threshold=100.0, window=20.0)
    _feed(ctl, {"a": 3, "b": 1}, 0, 60)
    assert ctl.maybe_replan(30.0) is None  # not due, no jump large enough
    assert ctl.maybe_replan(60.0) is None  # due: re-planned, same traffic, nothing moves
    assert ctl.last_plan == 60.0
    _feed(ctl, {"a": 1, "b": 3}, 60, 120)
    assert ctl.maybe_replan(119.0) is None  # the threshold is out of reach: waits for the interval
    replan = ctl.maybe_replan(120.0)
    assert replan is not None and replan.trigger == "interval"
    assert {m: len(mp.replicas) for m, mp in replan.placement.models.items()} == {"a": 1, "b": 3}
    assert ctl.placement is replan.placement and [a.action.op for a in replan.actions].count("add") == 2


def test_a_rate_jump_replans_before_the_interval():
    config = _config()
    ctl = ReplanController(config, plan(config), interval=600.0, threshold=0.5, window=10.0)
    _feed(ctl, {"a": 3, "b": 1}, 0, 20)
    assert ctl.maybe_replan(10.0) is None  # first full window: the baseline rates
    assert ctl.maybe_replan(20.0) is None  # same rates: no jump
    _feed(ctl, {"a": 1, "b": 3}, 20, 40)
    replan = ctl.maybe_replan(30.0)
    assert replan is not None and replan.trigger.startswith("threshold")
    assert len(replan.placement.models["b"].replicas) == 3
    assert ctl.maybe_replan(35.0) is None  # a fresh window must pass after a plan


def test_bad_settings_are_user_errors():
    config = _config()
    with pytest.raises(UserError, match="--replan-interval"):
        ReplanController(config, plan(config), interval=0)
    with pytest.raises(UserError, match="threshold"):
        ReplanController(config, plan(config), interval=10, threshold=-1)
