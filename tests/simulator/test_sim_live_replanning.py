"""Live re-planning in the simulator: a popularity shift moves replicas and loses no request."""

import dataclasses

import pytest

from paraflex.config.schema import Config
from paraflex.errors import UserError
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.workload.schedule import RateSchedule


def _config() -> Config:
    """Four A100 engines, two one-stage llama-20b models, a popular 3:1 at start."""
    return Config.from_dict({
        "cluster": {"num_engines": 4, "device": "a100-80g", "tp": 1, "memory_gb": 48, "host_memory_gb": 64},
        "models": [{"name": "a", "arch": "llama-20b", "rate": 3}, {"name": "b", "arch": "llama-20b", "rate": 1}],
        "planner": {"kappa_gb": 1},
        # least outstanding spreads every model over all its replicas, so the new replicas'
        # requests show they joined dispatch (least load keeps b whole while one replica suffices)
        "scheduler": {"dispatch": "least-outstanding"},
        "workload": {"arrival": "poisson", "duration_s": 120, "seed": 1},
    })


SHIFT = {"a": RateSchedule.steps([(0, 1.0), (60, 1 / 3)]), "b": RateSchedule.steps([(0, 1.0), (60, 3.0)])}


def test_a_shift_moves_replicas_to_the_new_popular_model_and_loses_no_request():
    config = _config()
    settings = SimSettings(rate=4.0, seed=1, replan_interval=20.0)
    result = simulate(config, settings, schedules=SHIFT)
    live = result.summary["live_replanning"]
    assert live["replica_adds"] >= 2 and live["replica_removes"] >= 2
    change = live["changes"][0]
    assert change["at"] > 60  # after the shift, not before
    assert {a["model"] for a in change["actions"] if a["op"] == "add"} == {"b"}
    assert {a["model"] for a in change["actions"] if a["op"] == "remove"} == {"a"}
    assert live["moved_weight_bytes"] == sum(a["weight_bytes"] for a in change["actions"] if a["op"] == "add")
    records = result.metrics.requests.values()
    assert len(records) == result.summary["workload"]["requests"]
    assert all(r.finish >= 0 and r.tokens == r.output_len for r in records)  # every request ended, all tokens
    for eng in result.engines:  # the KV accounting holds, and each engine's pool holds its replicas' weights
        eng.pool.check()
        assert eng.pool.num_used == eng.pool.used_by("weights") > 0
        assert eng.scheduler.num_live == 0 and len(eng.stages) == len(eng.scheduler.stages)
    late_b = [r for r in records if r.model == "b" and r.arrival > change["at"] + live["add_ready_s_max"]]
    assert len({r.replica for r in late_b}) >= 3  # the new replicas serve


def test_no_change_without_a_shift_and_the_flag_is_paraflex_only():
    config = _config()
    steady = simulate(config, SimSettings(rate=4.0, seed=1, replan_interval=20.0))
    assert steady.summary["live_replanning"]["replans"] == 0
    with pytest.raises(UserError, match="--system paraflex"):
        simulate(config, dataclasses.replace(SimSettings(rate=4.0, replan_interval=20.0), system="ray-serve"))
