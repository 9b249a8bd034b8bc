"""The engine loop's lines fitted from an engine step log (paraflex/costs/loop_fit.py) and used
by the cost model at each step's size (EngineLoopTerm.from_lines)."""

import csv
import random
from types import SimpleNamespace

import pytest

from paraflex.costs.costmodel import CostModel
from paraflex.costs.loop_fit import (OUTLIER_FACTOR, fit_loop_lines, read_step_log, stage_time_fn, step_size,
                                     step_spreads, weighted_line)
from paraflex.costs.serving_terms import EngineLoopTerm
from paraflex.engine.step_log import STEP_LOG_COLUMNS
from paraflex.errors import UserError
from paraflex.models.catalog import get_arch
from paraflex.placement import ModelPlacement


def _row(model, kind, size, busy_s, stage=0):
    return {"engine": "0", "model": model, "stage": str(stage), "kind": kind,
            "batch_size": str(size if kind == "decode" else 1), "prefill_tokens": str(size if kind == "prefill" else 0),
            "total_context": str(20 * size if kind == "decode" else 0), "busy_s": str(busy_s)}


def test_weighted_line_goes_through_the_mean_at_each_size_weighted_by_its_steps():
    a, b = weighted_line({1: [1.0, 3.0], 3: [4.0]})  # means 2 at x=1 (2 steps) and 4 at x=3 (1 step)
    assert b == pytest.approx(1.0) and a == pytest.approx(1.0)
    assert weighted_line({4: [2.0, 4.0]}) == (3.0, 0.0)  # one size: flat at its mean


def test_the_lines_recover_a_load_following_loop_cost_under_heavy_tailed_noise():
    rng = random.Random(0)
    rows = []
    for _ in range(400):  # decode: 1 ms + 0.3 ms per request on top of a 2 ms stage; tails from other tenants
        b = rng.randint(1, 8)
        tail = rng.expovariate(1 / 0.0005)
        rows.append(_row("m", "decode", b, 0.002 + 0.001 + 0.0003 * b + tail))
    for p in (16, 32, 64, 128):
        rows += [_row("m", "prefill", p, 0.004 + 0.002 + 1e-5 * p) for _ in range(5)]
    rows.append(_row("m", "mixed", 3, 1.0))  # not used
    lines = fit_loop_lines(rows, lambda r: 0.002 if r["kind"] == "decode" else 0.004)
    e = lines["m"]
    assert e["decode_per_seq_s"] == pytest.approx(0.0003, abs=0.0001)
    assert e["decode_s"] == pytest.approx(0.0015, abs=0.0003)  # 1 ms + the tails' mean (0.5 ms): means, not medians
    assert e["prefill_s"] == pytest.approx(0.002) and e["prefill_per_token_s"] == pytest.approx(1e-5)
    assert e["steps"] == 420 and step_size(rows[-1]) is None


def test_one_off_steps_far_over_their_stage_time_are_left_out_and_counted():
    """Kernel compiles on first use (0.5-1.7 s prefills among ~15 ms ones on an H100) would lift
    the prefill line for every step; a step up to OUTLIER_FACTOR x its expected time (stage time +
    the median extra) still counts."""
    rows = [_row("m", "prefill", p, 0.012 + 1e-6 * p) for p in (64, 128, 256, 512) for _ in range(50)]
    rows += [_row("m", "prefill", p, 1.2) for p in (83, 499, 520)]  # compiles
    rows.append(_row("m", "prefill", 256, 0.009 * (OUTLIER_FACTOR - 1)))  # slow, but within the bound
    lines = fit_loop_lines(rows, lambda r: 0.009)
    e = lines["m"]
    assert e["outliers"] == 3 and e["steps"] == 201
    kept = [float(r["busy_s"]) - 0.009 for r in rows[:200]] + [0.009 * (OUTLIER_FACTOR - 2)]
    assert e["prefill_s"] + e["prefill_per_token_s"] * 240 == pytest.approx(sum(kept) / len(kept), rel=0.05)
    assert fit_loop_lines(rows[:200], lambda r: 0.009)["m"]["outliers"] == 0


def test_the_steps_spread_around_the_lines_mean_one_one_offs_left_out():
    """Decode steps of 2 and 6 ms around a 4 ms prediction (stage 1 ms + line 3 ms), one 1.2 s
    one-off; prefills all as predicted; a stretch of 2 on every other decode step doubles both the
    prediction and the step, so it changes nothing."""
    rows = [_row("m", "decode", 1, t) for t in (0.002, 0.006) * 50] + [_row("m", "decode", 1, 1.2)]
    rows += [_row("m", "prefill", 8, 0.004) for _ in range(20)]
    lines = {"m": {"prefill_s": 0.003, "prefill_per_token_s": 0.0, "decode_s": 0.003, "decode_per_seq_s": 0.0}}
    spread = step_spreads(rows, lambda r: 0.001, lines)
    assert spread["decode"][0] == pytest.approx(0.5) and spread["decode"][-1] == pytest.approx(1.5)
    assert spread["prefill"] == pytest.approx([1.0] * len(spread["prefill"]))
    stretched = [dict(r, busy_s=str(2 * float(r["busy_s"]))) if i % 2 else r for i, r in enumerate(rows)]
    stretches = [2.0 if i % 2 else 1.0 for i in range(len(rows))]
    assert step_spreads(stretched, lambda r: 0.001, lines, stretches) == spread


def test_the_cost_model_adds_the_line_at_the_steps_size_and_never_goes_below_the_ops():
    arch = get_arch("tiny-2l")
    bare, looped = CostModel("cpu"), CostModel("cpu")
    lines = {"m": {"prefill_s": 0.001, "prefill_per_token_s": 1e-5, "decode_s": 0.0005, "decode_per_seq_s": 0.0002,
                   "steps": 10},
             "n": {"prefill_s": -1.0, "prefill_per_token_s": 0.0, "decode_s": -1.0, "decode_per_seq_s": 0.0, "steps": 1}}
    term = EngineLoopTerm.from_lines(lines, {"m": arch, "n": get_arch("tiny-4l")})
    assert term.source == "steps" and term.requests == 11
    looped.engine_loop = term
    assert looped.decode_time(arch, 2, 4, 64) == pytest.approx(bare.decode_time(arch, 2, 4, 64) + 0.0013)
    assert looped.prefill_time(arch, 2, 100, last=True) == pytest.approx(bare.prefill_time(arch, 2, 100, last=True) + 0.002)
    four = get_arch("tiny-4l")  # a line far below zero: the stage costs its ops, no less
    assert looped.decode_time(four, 4, 2, 20) == pytest.approx(bare.decode_time(four, 4, 2, 20))
    assert term.stage_step_s(get_arch("tiny-8l"), False, 3) == term.step_s  # not logged: a constant
    old = EngineLoopTerm([{"model": "m", "key": term.per_model[0]["key"], "step_s": 0.002}], 0.002, 3)
    assert old.stage_step_s(arch, True, 500) == 0.002  # a profile from request logs: flat


def test_stage_time_of_a_logged_step_uses_its_stages_layers_and_ends(tmp_path):
    arch = get_arch("tiny-8l")
    placement = SimpleNamespace(models={"m": ModelPlacement("m", 8, [(0, 3), (3, 8)], [[0, 1]])})
    cost = CostModel("cpu")
    t = stage_time_fn(cost, placement, {"m": arch})
    assert t(_row("m", "decode", 2, 0, stage=1)) == cost.decode_time(arch, 5, 2, 40, first=False, last=True)
    assert t(_row("m", "prefill", 30, 0, stage=0)) == cost.prefill_time(arch, 3, 30, first=True, last=False)
    with open(tmp_path / "engine-0.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=STEP_LOG_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerow({**_row("m", "decode", 2, 0.01), "num_stages": 2, "resident_stages": 1, "crosses": 1,
                    "start_s": 1.0, "run_s": 0.005})
    assert read_step_log(str(tmp_path))[0]["busy_s"] == "0.01"
    with pytest.raises(UserError, match="--step-log"):
        read_step_log(str(tmp_path / "none"))
