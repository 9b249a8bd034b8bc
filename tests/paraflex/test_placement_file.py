"""The placement file: JSON round trip, versioning, structural checks on load."""

import json

import pytest

from paraflex.errors import UserError
from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef


def _sample() -> Placement:
    models = {
        "big": ModelPlacement("big", 6, [(0, 2), (2, 4), (4, 6)], [[0, 1, 2]]),
        "small": ModelPlacement("small", 2, [(0, 2)], [[1], [3]]),
    }
    engines = [
        EnginePlacement(0, [StageRef("big", 0, 0)], 100, {"big": 50}),
        EnginePlacement(1, [StageRef("big", 0, 1), StageRef("small", 0, 0)], 150, {"big": 50, "small": 40}),
        EnginePlacement(2, [StageRef("big", 0, 2)], 100, {"big": 50}),
        EnginePlacement(3, [StageRef("small", 1, 0)], 60, {"small": 40}),
    ]
    return Placement(1, "paraflex", {"engine_memory_bytes": 1000}, 0.04, models, engines)


def test_round_trip(tmp_path):
    p = _sample()
    path = tmp_path / "p.json"
    p.save(path)
    q = Placement.load(path)
    assert q == p
    assert q.models["big"].engine_of(0, 2) == 2
    assert q.stage_layers("big", 1) == (2, 4)
    assert q.num_engines == 4
    assert q.engine(1).kv_bytes == {"big": 50, "small": 40}


def test_sound_sample_has_no_problems():
    assert _sample().structural_problems() == []


def test_wrong_version_is_rejected(tmp_path):
    d = _sample().to_dict()
    d["version"] = 99
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match="version"):
        Placement.load(path)


def test_not_a_placement_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"cluster": {}}))
    with pytest.raises(UserError, match="format"):
        Placement.load(path)


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="paraflex plan"):
        Placement.load(tmp_path / "nope.json")


def test_wrong_type_names_the_field():
    d = _sample().to_dict()
    d["engines"][2]["weight_bytes"] = "lots"
    with pytest.raises(UserError, match=r"engines\[2\]\.weight_bytes"):
        Placement.from_dict(d)


def test_layer_gap_is_structural_problem():
    d = _sample().to_dict()
    d["models"]["big"]["stages"][1] = [3, 4]
    with pytest.raises(UserError, match="stage 1 covers layers"):
        Placement.from_dict(d)
    p = Placement.from_dict(d, check=False)
    assert any("stage 1" in s for s in p.structural_problems())


def test_engine_listing_mismatch_detected():
    d = _sample().to_dict()
    d["engines"][3]["stages"] = []
    p = Placement.from_dict(d, check=False)
    problems = p.structural_problems()
    assert any("engine 3 does not list small replica 1 stage 0" in s for s in problems)


def test_engine_out_of_range_detected():
    d = _sample().to_dict()
    d["models"]["small"]["replicas"][1] = [7]
    p = Placement.from_dict(d, check=False)
    assert any("engine 7 out of range" in s for s in p.structural_problems())
