"""Incremental re-planning: hysteresis keeps a placement under noise, a popularity shift moves
replicas towards the new popular model with the fewest bytes, and no fit is a UserError."""

import pytest

from paraflex.config.schema import Config, load_config
from paraflex.errors import UserError
from paraflex.planner.api import plan
from paraflex.planner.incremental import IncrementalPlanner, demand_objective
from paraflex.planner.placement_diff import diff_placements, moved_bytes
from repo_paths import CONFIGS

PAPER_BASE = CONFIGS / "paper-base.yaml"


def _two_models(rate_a: float, rate_b: float, kappa_gb: float = 1, stage_time: str = "auto") -> Config:
    """Four engines, two one-stage llama-20b models (23.1 GiB of weights each): two replicas fit an
    engine; `stage_time` "/2" cuts each into two stages instead."""
    return Config.from_dict({
        "cluster": {"num_engines": 4, "device": "a100-80g", "tp": 1, "memory_gb": 48},
        "models": [{"name": "a", "arch": "llama-20b", "rate": rate_a}, {"name": "b", "arch": "llama-20b", "rate": rate_b}],
        "planner": {"kappa_gb": kappa_gb, "target_stage_time": stage_time},
    })


def _cuts(placement):
    return {m: [tuple(s) for s in mp.stages] for m, mp in placement.models.items()}


def _replicas(placement):
    return {m: len(mp.replicas) for m, mp in placement.models.items()}


def test_same_rates_keep_the_placement():
    config = _two_models(3, 1)
    current = plan(config)
    result = IncrementalPlanner(config).replan(current, {"a": 3, "b": 1})
    assert result.candidate == "kept" and result.actions == [] and result.placement is current


@pytest.mark.parametrize("noise", [(1.1, 0.9), (0.9, 1.1), (1.05, 0.8)])
def test_hysteresis_keeps_the_placement_under_small_rate_noise(noise):
    config = load_config(PAPER_BASE)
    current = plan(config)
    rates = {m.name: m.rate * 4 * noise[i % 2] for i, m in enumerate(config.models)}
    result = IncrementalPlanner(config, hysteresis=0.1).replan(current, rates)
    assert result.candidate == "kept" and not result.changed


def test_the_margin_keeps_a_placement_a_small_gain_would_move():
    config = _two_models(3, 1)
    current = plan(config)
    rates = {"a": 3, "b": 1.6}  # one more replica of b would raise the objective by 6.6%
    eager = IncrementalPlanner(config, hysteresis=0.0).replan(current, rates)
    assert eager.changed and 1.0 < eager.objective_after / eager.objective_before < 1.1
    assert not IncrementalPlanner(config, hysteresis=0.1).replan(current, rates).changed


def test_a_popularity_shift_moves_replicas_to_the_new_popular_model_with_the_fewest_bytes():
    config = _two_models(3, 1)
    current = plan(config)
    assert _replicas(current) == {"a": 3, "b": 1}
    planner = IncrementalPlanner(config)
    result = planner.replan(current, {"a": 1, "b": 3})
    assert result.candidate == "incremental"
    assert _replicas(result.placement) == {"a": 1, "b": 3}
    # hand check: b needs two more replicas, so two adds are the least any plan can load; a's
    # surplus replicas are removed (they free memory and load nothing)
    replica_bytes = config.models[1].arch.weight_bytes()
    assert sorted((p.action.op, p.action.model) for p in result.actions) == [("add", "b"), ("add", "b"), ("remove", "a"), ("remove", "a")]
    assert result.moved_bytes == 2 * replica_bytes
    fresh = plan(config, rates={"a": 1, "b": 3})
    assert moved_bytes(diff_placements(current, fresh, planner.weights)) >= result.moved_bytes
    assert result.objective_after > result.objective_before * 1.1
    adds = [p for p in result.actions if p.action.op == "add"]
    assert all(0.25 < p.load_s < 5 for p in adds) and all(p.load_s == 0 for p in result.actions if p.action.op == "remove")


def test_paper_base_shift_gives_the_new_top_model_more_replicas():
    config = load_config(PAPER_BASE)
    current = plan(config)
    names = [m.name for m in config.models]
    rates = dict(zip(names, reversed([m.rate * 4 for m in config.models])))  # the largest model becomes the most popular
    result = IncrementalPlanner(config).replan(current, rates)
    assert result.changed
    before, after = _replicas(current), _replicas(result.placement)
    assert after["internlm2.5-20b-chat-1"] < before["internlm2.5-20b-chat-1"]
    assert after["codellama-34b-instruct"] > before["codellama-34b-instruct"]
    assert demand_objective(result.placement, result.rates, config.cluster.memory_bytes) == result.objective_after


def test_an_idle_model_keeps_a_replica():
    config = _two_models(3, 1)
    result = IncrementalPlanner(config).replan(plan(config), {"a": 5, "b": 0})
    assert _replicas(result.placement)["b"] >= 1


def test_no_fitting_placement_is_a_user_error():
    config = _two_models(3, 1)
    current = plan(config)
    greedy = _two_models(3, 1, kappa_gb=40)  # 40 GiB of KV per stage: 3 stages each, 6 x 47.7 GiB > 4 x 48 GiB
    with pytest.raises(UserError, match="re-planning for rates a=1, b=3: no feasible placement"):
        IncrementalPlanner(greedy).replan(current, {"a": 1, "b": 3})


def test_a_placement_of_another_config_and_bad_rates_are_user_errors():
    config = _two_models(3, 1)
    other = Config.from_dict({**config.to_dict(), "models": [{"name": "c", "arch": "llama-20b"}]})
    with pytest.raises(UserError, match="not for this config"):
        IncrementalPlanner(config).replan(plan(other), {"a": 1, "b": 1})
    with pytest.raises(UserError, match="rate of 'a'"):
        IncrementalPlanner(config).replan(plan(config), {"a": -1, "b": 1})


def test_keep_cuts_moves_replicas_of_the_serving_cut_where_the_configs_cut_would_do_nothing():
    current = plan(_two_models(3, 1))  # one stage each: a on 3 engines, b on 1
    config = _two_models(3, 1, stage_time="/2")  # the config's own cut is two stages
    shift = {"a": 1, "b": 3}
    assert not IncrementalPlanner(config).replan(current, shift).changed  # re-cutting gains too little
    result = IncrementalPlanner(config, keep_cuts=True).replan(current, shift)
    assert result.candidate == "incremental" and _cuts(result.placement) == _cuts(current)
    assert _replicas(result.placement) == {"a": 1, "b": 3}
    assert sorted((p.action.op, p.action.model) for p in result.actions) == [("add", "b"), ("add", "b"), ("remove", "a"), ("remove", "a")]
    assert all([tuple(s) for s in p.action.stages] == _cuts(current)[p.action.model] for p in result.actions)


@pytest.mark.parametrize("shift", [{"a": 1, "b": 3}, {"a": 1, "b": 9}, {"a": 5, "b": 0}])
def test_keep_cuts_never_re_cuts_where_the_default_mode_does(shift):
    current = plan(_two_models(3, 1, stage_time="/2"))  # two stages each
    config = _two_models(3, 1)  # the config's own cut is one stage
    default = IncrementalPlanner(config, hysteresis=0.0).replan(current, shift)
    assert default.changed and _cuts(default.placement) != _cuts(current)  # the gap keep_cuts closes
    kept = IncrementalPlanner(config, hysteresis=0.0, keep_cuts=True).replan(current, shift)
    assert _cuts(kept.placement) == _cuts(current)
    assert all([tuple(s) for s in p.action.stages] == _cuts(current)[p.action.model] for p in kept.actions)
