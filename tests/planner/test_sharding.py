"""Sharding (§4.1): stage counts from times, even layer split, stage weights from the catalog."""

from hypothesis import given
from hypothesis import strategies as st

from paraflex.models.catalog import get_arch
from paraflex.config.schema import Config
from paraflex.planner.problem import split_layers
from paraflex.planner.sharding import build_problem, stage_count


def test_stage_count_rounds_half_up_and_clamps():
    assert stage_count(2.5, 1.0, 32) == 3
    assert stage_count(2.49, 1.0, 32) == 2
    assert stage_count(0.2, 1.0, 32) == 1  # at least one stage
    assert stage_count(100.0, 1.0, 8) == 8  # at most one stage per layer


def test_split_remainder_goes_to_first_stages():
    assert split_layers(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert split_layers(80, 3) == ((0, 27), (27, 54), (54, 80))
    assert split_layers(5, 5) == tuple((k, k + 1) for k in range(5))


@given(st.integers(1, 300), st.data())
def test_split_is_even_and_covers_every_layer(num_layers, data):
    s = data.draw(st.integers(1, num_layers))
    stages = split_layers(num_layers, s)
    sizes = [b - a for a, b in stages]
    assert stages[0][0] == 0 and stages[-1][1] == num_layers
    assert all(stages[k][1] == stages[k + 1][0] for k in range(s - 1))
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # remainder from the first stage on
    assert sizes.count(num_layers // s + 1) == num_layers % s


def _config(target="auto", engines=8):
    return Config.from_dict({
        "cluster": {"num_engines": engines, "device": "a100-80g", "tp": 1, "memory_gb": 80},
        "models": [
            {"name": "small", "arch": "llama-20b", "rate": 1},
            {"name": "mid", "arch": "llama-40b", "rate": 1},
            {"name": "big", "arch": "llama-80b", "rate": 1},
        ],
        "planner": {"target_stage_time": target, "kappa_gb": 1},
    })


def test_auto_target_gives_smallest_model_one_stage_and_depth_scaled_others():
    problem, facts = build_problem(_config())
    counts = {m.name: m.num_stages for m in problem.models}
    assert counts == {"small": 1, "mid": 2, "big": 4}  # 60/120/240 layers of equal width
    assert facts["target_stage_time_ms"] == min(facts["model_time_ms"].values())


def test_multiples_and_submultiples_of_auto():
    half, _ = build_problem(_config("/2"))
    double, _ = build_problem(_config("x2"))
    assert [m.num_stages for m in half.models] == [2, 4, 8]
    assert [m.num_stages for m in double.models] == [1, 1, 2]


def test_target_in_milliseconds():
    _, facts = build_problem(_config())
    small_ms = facts["model_time_ms"]["small"]
    problem, facts2 = build_problem(_config(small_ms / 3))
    assert facts2["target_stage_time_ms"] == small_ms / 3
    assert problem.models[0].num_stages == 3


def test_stage_weights_are_the_catalogs_stage_bytes():
    problem, _ = build_problem(_config())
    arch = get_arch("llama-80b")
    big = problem.models[2]
    last = big.num_stages - 1
    assert big.stage_weights == tuple(
        arch.stage_weight_bytes(a, b, k == 0, k == last) for k, (a, b) in enumerate(big.stages)
    )
    assert sum(big.stage_weights) == arch.weight_bytes()
    assert big.stage_weights[0] > big.stage_weights[1]  # embedding on the first stage


def test_more_stages_than_engines_is_capped_with_a_warning():
    problem, facts = build_problem(_config("/4", engines=8))
    assert [m.num_stages for m in problem.models] == [4, 8, 8]
    assert any("big" in w and "16 stages" in w for w in facts["warnings"])


def _two_70b(memory_gb=72, kappa_gb=6, engines=8):
    return Config.from_dict({
        "cluster": {"num_engines": engines, "device": "a100-80g", "tp": 1, "memory_gb": memory_gb},
        "models": [{"name": "a", "arch": "llama-2-70b"}, {"name": "b", "arch": "llama-2-70b"}],
        "planner": {"target_stage_time": "auto", "kappa_gb": kappa_gb},
    })


def test_stage_count_is_raised_until_a_stage_fits_an_engine():
    """Two llama-2-70b at TP 1: `auto` makes T_s the model's own time (S = 1), but 128 GiB of
    weights cannot sit on a 72 GiB engine: S rises to the fewest stages that fit with kappa."""
    problem, facts = build_problem(_two_70b())
    assert [m.num_stages for m in problem.models] == [2, 2]
    assert all(max(m.stage_weights) + 6 * 2**30 <= 72 * 2**30 for m in problem.models)
    assert any("using 2 stages" in w and "GiB" in w for w in facts["warnings"])
    # a larger kappa needs one more stage
    problem, _ = build_problem(_two_70b(kappa_gb=10))
    assert [m.num_stages for m in problem.models] == [3, 3]


def test_a_model_too_large_for_any_cut_says_to_add_memory_not_fewer_stages():
    import pytest

    from paraflex.errors import UserError

    with pytest.raises(UserError) as info:
        build_problem(_two_70b(memory_gb=40, kappa_gb=10, engines=4))  # 4 stages of 32 GiB + 10 > 40 GiB
    msg = str(info.value)
    assert "memory_gb" in msg and "GiB" in msg and " GB" not in msg
    assert "raise planner.target_stage_time" not in msg


def _fixed(stages, memory_gb=80, kappa_gb=1, engines=8):
    return Config.from_dict({
        "cluster": {"num_engines": engines, "device": "a100-80g", "tp": 1, "memory_gb": memory_gb},
        "models": [{"name": "small", "arch": "llama-20b"}, {"name": "big", "arch": "llama-80b", "stages": stages}],
        "planner": {"target_stage_time": "auto", "kappa_gb": kappa_gb},
    })


def test_configured_stages_replace_the_time_based_cut():
    problem, facts = build_problem(_fixed(6))
    big = problem.models[1]
    assert big.num_stages == 6 and big.stages == split_layers(240, 6)  # even cut, not time-based (4)
    assert problem.models[0].num_stages == 1  # the others keep the time-based cut
    assert facts["fixed_stages"] == {"big": 6} and not facts["warnings"]


def test_configured_stages_that_do_not_fit_an_engine_name_the_field_and_the_fewest_that_fit():
    import pytest

    from paraflex.errors import ConfigError
    from paraflex.planner.problem import ModelSpec

    arch = get_arch("llama-80b")
    fits = [k for k in range(1, 9)
            if max(ModelSpec.from_arch("big", 240, k, 1, arch).stage_weights) + 10 * 2**30 <= 80 * 2**30]
    with pytest.raises(ConfigError) as info:
        build_problem(_fixed(fits[0] - 1, kappa_gb=10))
    assert info.value.path == "models[1].stages"
    assert f"use stages: {fits[0]} or more" in str(info.value)
    assert build_problem(_fixed(fits[0], kappa_gb=10))[0].models[1].num_stages == fits[0]


def test_the_planner_places_a_configured_cut_unchanged():
    from paraflex.planner import plan

    placement = plan(_fixed(6))
    big = placement.models["big"]
    assert big.stages == list(split_layers(240, 6))
    assert all(len(r) == 6 for r in big.replicas)
    assert placement.params["fixed_stages"] == {"big": 6}
