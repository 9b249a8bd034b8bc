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
    assert o.stage_residual(four, 4, prefill=True, size=64) == pytest.approx(0.02)
    assert o.stage_residual(four, 1, prefill=False, size=4) == pytest.approx(0.001)
    assert o.stage_residual(eight, 8, prefill=True, size=64) == 0.0  # another model: unmeasured


def test_a_negative_residual_adds_nothing_and_no_file_means_none(tmp_path):
    four = get_arch("tiny-4l")
    o = StepOverheads.load(_dir(tmp_path, StepOverhead.of("m", four, prefill_s=-0.5, decode_s=-0.1)))
    assert o.stage_residual(four, 4, prefill=True, size=16) == 0.0
    assert not StepOverheads.load(str(tmp_path / "nowhere"))


def test_the_residual_grows_with_the_steps_size_and_a_line_below_zero_is_cut_at_zero(tmp_path):
    four = get_arch("tiny-4l")
    o = StepOverheads.load(_dir(tmp_path, StepOverhead.of("m", four, prefill_s=0.001, decode_s=-0.002,
                                                          prefill_per_token_s=1e-5, decode_per_seq_s=1e-3)))
    assert o.stage_residual(four, 4, prefill=True, size=100) == pytest.approx(0.002)
    assert o.stage_residual(four, 2, prefill=True, size=100) == pytest.approx(0.001)  # half the layers
    assert o.stage_residual(four, 4, prefill=False, size=1) == 0.0  # -1 ms: adds nothing
    assert o.stage_residual(four, 4, prefill=False, size=6) == pytest.approx(0.004)


def test_an_older_profile_without_slopes_reads_as_flat_lines(tmp_path):
    four = get_arch("tiny-4l")
    entry = StepOverhead.of("m", four, prefill_s=0.02, decode_s=0.004).to_dict()
    del entry["prefill_per_token_s"], entry["decode_per_seq_s"]
    (tmp_path / PROFILE_FILE).write_text(json.dumps({"step_overheads": [entry]}))
    o = StepOverheads.load(str(tmp_path))
    assert o.stage_residual(four, 4, prefill=True, size=16) == o.stage_residual(four, 4, prefill=True, size=512)



def test_packed_prompts_and_context_add_their_measured_costs_and_the_cost_model_passes_them(tmp_path):
    four = get_arch("tiny-4l")
    profile = _dir(tmp_path, StepOverhead.of("m", four, prefill_s=0.001, decode_s=0.001, prefill_per_extra_seq_s=2e-4,
                                             decode_per_context_s=1e-6))
    o = StepOverheads.load(profile)
    assert o.stage_residual(four, 4, prefill=True, size=100, num_seqs=4) == pytest.approx(0.001 + 3 * 2e-4)
    assert o.stage_residual(four, 4, prefill=False, size=2, context=1000) == pytest.approx(0.001 + 1e-3)
    from paraflex.costs.costmodel import CostModel

    plain, measured = CostModel("a100-80g"), CostModel("a100-80g")
    measured.overheads = o  # what `profile_dir` loads beside its tables
    extra = lambda f: f(measured) - f(plain)  # noqa: E731  (the residual the profile adds)
    assert extra(lambda c: c.prefill_time(four, 4, 100, num_seqs=4)) == pytest.approx(0.0016)
    assert extra(lambda c: c.decode_time(four, 4, 2, 1000)) == pytest.approx(0.002)
