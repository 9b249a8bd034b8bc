"""Baseline layouts: dedicated, shared, grouped, tensor."""

import pytest

from paraflex.errors import UserError
from paraflex.planner import baselines
from paraflex.planner.assemble import to_placement
from paraflex.planner.problem import ModelSpec, Problem, UniformLayers


def _model(name, layers, rate=1.0, layer_bytes=10):
    return ModelSpec.from_arch(name, layers, 1, rate, UniformLayers(layer_bytes, 2, 2))


def _problem(n=8, memory=1000, kappa=10):
    return Problem((_model("big", 16, 1.0, 20), _model("mid", 8, 2.0, 18), _model("s1", 4, 4.0, 5), _model("s2", 4, 1.0, 5)),
                   n, memory, kappa_bytes=kappa)


def test_dedicated_two_stages_each_on_own_engines():
    laid, sol = baselines.dedicated(_problem())
    assert [m.num_stages for m in laid.models] == [2, 2, 2, 2]
    assert sol.replicas == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    engines = [e for reps in sol.replicas for r in reps for e in r]
    assert len(engines) == len(set(engines))  # nothing shared


def test_dedicated_grows_pp_when_two_stages_do_not_fit():
    laid, sol = baselines.dedicated(_problem(n=10, memory=100))  # big: 8 layers x 20 per stage > 100 - 10
    assert laid.models[0].num_stages == 4
    assert sol.replicas[0] == [[0, 1, 2, 3]]


def test_dedicated_needs_enough_engines():
    with pytest.raises(UserError, match="dedicated layout needs 8 engines"):
        baselines.dedicated(_problem(n=6))


def test_shared_puts_every_model_on_every_engine():
    laid, sol = baselines.shared(_problem(n=6))
    assert [m.num_stages for m in laid.models] == [6, 6, 4, 4]  # 4-layer models use their first 4 engines
    assert sol.replicas[0] == [[0, 1, 2, 3, 4, 5]]
    assert sol.replicas[2] == [[0, 1, 2, 3]]


def test_grouped_splits_by_size_and_demand():
    problem = _problem()
    groups = baselines.size_groups(problem)
    assert groups == [[0, 1], [2, 3]]  # 16x20 and 8x18 bytes vs 4x5: the biggest gap
    laid, sol = baselines.grouped(problem)
    # demand big 320*1/8 + mid 144*2/8 = 76 vs small 20*4/8 + 20*1/8 = 12.5 -> 8 * 76/88.5 = 6.9
    assert sol.replicas[0] == [[0, 1, 2, 3, 4, 5, 6]]
    assert sol.replicas[1] == [[0, 1, 2, 3, 4, 5, 6]]
    assert sol.replicas[2] == [[7]] and sol.replicas[3] == [[7]]


def test_grouped_single_group_when_sizes_are_close():
    problem = Problem((_model("a", 8), _model("b", 6)), 4, 1000)
    assert baselines.size_groups(problem) == [[0, 1]]


def test_tensor_is_one_engine_with_all_memory():
    laid, sol = baselines.tensor(_problem())
    assert laid.num_engines == 1 and laid.memory_bytes == 8000
    assert all(m.num_stages == 1 for m in laid.models)
    placement = to_placement(laid, sol, "tensor", {})
    assert len(placement.engines) == 1
    assert sorted(placement.engines[0].kv_bytes) == ["big", "mid", "s1", "s2"]


@pytest.mark.parametrize("name", ["dedicated", "shared", "grouped", "tensor"])
def test_baselines_assemble_to_sound_placements(name):
    laid, sol = getattr(baselines, name)(_problem())
    placement = to_placement(laid, sol, name, {})
    assert placement.structural_problems() == []
    for e in placement.engines:
        assert e.weight_bytes + sum(e.kv_bytes.values()) <= laid.memory_bytes
