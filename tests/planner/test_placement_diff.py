"""placement_diff: kept replicas cost nothing; moved replicas are a remove plus an add."""

import pytest

from paraflex.placement import Placement
from paraflex.planner.placement_diff import diff_placements, moved_bytes
from paraflex.planner.problem import UniformLayers


def _placement(models: dict, num_engines: int = 4) -> Placement:
    engines = [{"id": e, "stages": [], "weight_bytes": 0, "kv_bytes": {}} for e in range(num_engines)]
    out = {}
    for name, (stages, replicas) in models.items():
        out[name] = {"num_layers": stages[-1][1], "stages": stages, "replicas": replicas}
        for j, rep in enumerate(replicas):
            for k, e in enumerate(rep):
                engines[e]["stages"].append({"model": name, "replica": j, "stage": k})
                engines[e]["kv_bytes"][name] = 1
    return Placement.from_dict({"format": "paraflex-placement", "version": 1, "planner": "test", "params": {},
                                "objective": 0.0, "models": out, "engines": engines})


WEIGHTS = {"a": UniformLayers(10, first_bytes=1, last_bytes=2), "b": UniformLayers(100)}


def test_same_placement_is_no_action():
    p = _placement({"a": ([[0, 2], [2, 4]], [[0, 1]]), "b": ([[0, 4]], [[2], [3]])})
    assert diff_placements(p, p, WEIGHTS) == []


def test_added_and_removed_replicas_with_their_bytes():
    old = _placement({"a": ([[0, 2], [2, 4]], [[0, 1]]), "b": ([[0, 4]], [[2], [3]])})
    new = _placement({"a": ([[0, 2], [2, 4]], [[0, 1], [2, 3]]), "b": ([[0, 4]], [[3]])})
    actions = diff_placements(old, new, WEIGHTS)
    assert [(a.op, a.model, a.replica, a.engines) for a in actions] == [
        ("remove", "b", 0, (2,)), ("add", "a", 1, (2, 3))]
    assert actions[1].weight_bytes == 4 * 10 + 1 + 2
    assert moved_bytes(actions) == 43


def test_a_new_cut_replaces_every_replica():
    old = _placement({"a": ([[0, 4]], [[0]])})
    new = _placement({"a": ([[0, 1], [1, 4]], [[0, 1]])})
    actions = diff_placements(old, new, WEIGHTS)
    assert [(a.op, a.stages) for a in actions] == [("remove", ((0, 4),)), ("add", ((0, 1), (1, 4)))]


def test_engine_count_must_match():
    with pytest.raises(ValueError, match="engines"):
        diff_placements(_placement({"a": ([[0, 4]], [[0]])}, 4), _placement({"a": ([[0, 4]], [[0]])}, 5), WEIGHTS)
