"""Time-varying workloads: rate schedules warp any arrival process to follow the multiplier."""

import numpy as np
import pytest

from paraflex.config.schema import WorkloadConfig
from paraflex.errors import UserError
from paraflex.simulator.workload import WorkloadModel, generate
from paraflex.simulator.workload.schedule import RateSchedule, parse_schedules


def test_steps_with_an_idle_gap_integrate_exactly():
    s = RateSchedule.steps([(0, 1.0), (100, 0.0), (200, 3.0)])
    assert s.cumulative(100) == pytest.approx(100)
    assert s.cumulative(200) == pytest.approx(100)
    assert s.cumulative(300) == pytest.approx(400)
    assert s.warp([50, 100.5, 250], 300) == pytest.approx([50, 200 + 0.5 / 3, 250 / 3 + 200 - 100 / 3])


def test_ramp_and_diurnal_shapes():
    r = RateSchedule.ramp(10, 20, 1.0, 3.0)
    assert r.cumulative(30) == pytest.approx(10 + 20 + 30)
    d = RateSchedule.diurnal(100, 0.5, 1.5, 200)
    assert d.at(0) == pytest.approx(0.5) and d.at(50) == pytest.approx(1.5)
    assert d.cumulative(200) == pytest.approx(200, rel=1e-3)  # mean multiplier 1


@pytest.mark.parametrize("arrival", ["poisson", "lognormal"])
def test_generated_arrivals_follow_the_schedule(arrival):
    models = [WorkloadModel("a", 4096, 0.5), WorkloadModel("b", 4096, 0.5)]
    schedules = {"a": RateSchedule.steps([(0, 2.0), (200, 0.0), (300, 1.0)])}
    w = WorkloadConfig(arrival=arrival, cv=2.0, duration_s=400)
    requests, info = generate(models, w, 20.0, seed=3, schedules=schedules)
    a = np.array([r.arrival for r in requests if r.model == "a"])
    assert not ((a >= 200) & (a < 300)).any()  # the idle gap
    first, last = ((a < 200).sum() / 200), ((a >= 300).sum() / 100)
    assert first == pytest.approx(20.0, rel=0.35) and last == pytest.approx(10.0, rel=0.35)
    b = np.array([r.arrival for r in requests if r.model == "b"])
    assert len(b) / 400 == pytest.approx(10.0, rel=0.35)  # unscheduled: its own rate throughout


def test_schedule_from_a_traces_own_arrivals_has_mean_one():
    s = RateSchedule.from_arrivals([0.5, 1.0, 1.5, 12.0], window_s=10)
    assert s.values[0] == pytest.approx(1.5) and s.values[-1] == pytest.approx(0.5)


def test_bad_schedules_are_user_errors():
    with pytest.raises(UserError, match="multipliers"):
        RateSchedule.steps([(0, -1.0)])
    with pytest.raises(UserError, match="unknown model"):
        parse_schedules({"zz": {"kind": "steps", "points": [[0, 1]]}}, ["a"])
    with pytest.raises(UserError, match="kind must be"):
        parse_schedules({"a": {"kind": "sine"}}, ["a"])
    with pytest.raises(UserError, match="missing or bad field"):
        parse_schedules({"a": {"kind": "ramp", "t0": 1}}, ["a"])
    assert parse_schedules({"a": {"kind": "diurnal", "period_s": 60, "low": 0.2, "high": 2, "horizon_s": 120}}, ["a"])["a"].at(30) == pytest.approx(2)
