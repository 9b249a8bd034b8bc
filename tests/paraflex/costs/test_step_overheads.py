"""Measured per-step residuals (paraflex/costs/step_overheads.py): matched by shape, vocabulary
and depth, added pro rata to a stage's layers, never subtracting time."""

import json

import pytest

from paraflex.costs.step_overheads import PROFILE_FILE, StepOverhead, StepOverheads
from paraflex.models.catalog import get_arch


def _dir(tmp_path, *entries):
    (tmp_path / PROFILE_FILE).write_text(json.dumps({"step_overheads": [e.to_dict() for e in entries]}))
    return str(tmp_path)


def test_residual_is_pro_rata_to_the_stages_layers_and_matched_by_depth(tmp_path):
    four, eight = get_arch("tiny-4l"), get_arch("tiny-8l")
    o = StepOverheads.load(_dir(tmp_path, StepOverhead.of("m", four, prefill_s=0.02, decode_s=0.004)))
    assert o.stage_residual(four, 4, prefill=True) == pytest.approx(0.02)
    assert o.stage_residual(four, 1, prefill=False) == pytest.approx(0.001)
    assert o.stage_residual(eight, 8, prefill=True) == 0.0  # another model: unmeasured


def test_a_negative_residual_adds_nothing_and_no_file_means_none(tmp_path):
    four = get_arch("tiny-4l")
    o = StepOverheads.load(_dir(tmp_path, StepOverhead.of("m", four, prefill_s=-0.5, decode_s=-0.1)))
    assert o.stage_residual(four, 4, prefill=True) == 0.0
    assert not StepOverheads.load(str(tmp_path / "nowhere"))
