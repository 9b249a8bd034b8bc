"""The projection layout chooser: the pure verdict from fake timings, and one real small shape
measured, cached on disk and read back."""

import json
from unittest import mock

import pytest
import torch

from paraflex.engine.worker.model import layout_chooser
from paraflex.engine.worker.model import linear as linear_module
from paraflex.engine.worker.model.layout_choice import DECODE_ROWS, MARGIN, PREFILL_ROWS, choose_layout
from paraflex.engine.worker.model.layout_chooser import LayoutChooser
from paraflex.engine.worker.model.linear import Linear

ROWS = DECODE_ROWS + PREFILL_ROWS


def times(**per_layout):
    """layout -> rows -> seconds from `layout=(decode seconds, prefill seconds)` per row."""
    return {name: {r: (d if r in DECODE_ROWS else p) * r for r in ROWS} for name, (d, p) in per_layout.items()}


def test_the_layout_fastest_at_every_row_count_wins_with_no_split():
    v = choose_layout(times(panels=(2.0, 2.0), onednn=(1.0, 1.0), mm=(3.0, 3.0)))
    assert v.layout == "onednn" and v.split is None
    assert v.scores == pytest.approx({"panels": 2.0, "onednn": 1.0, "mm": 3.0})


def test_the_preferred_layout_stays_unless_another_beats_it_by_the_margin():
    close = 1 - MARGIN / 2
    assert choose_layout(times(panels=(1.0, 1.0), onednn=(close, close))).layout == "panels"
    far = 1 - 2 * MARGIN
    assert choose_layout(times(panels=(1.0, 1.0), onednn=(far, far))).layout == "onednn"


def test_decode_and_prefill_disagreeing_keep_one_layout_and_say_what_the_other_would_gain():
    # panels 1.5x faster at decode rows, oneDNN 2x faster at prefill rows: over five row counts
    # (three decode, two prefill) panels score 2^(2/5) = 1.32, oneDNN 1.5^(3/5) = 1.28: oneDNN
    v = choose_layout(times(panels=(1.0, 2.0), onednn=(1.5, 1.0)))
    assert v.layout == "onednn"
    assert v.split == "panels would be 1.50x faster at decode rows"
    v = choose_layout(times(panels=(1.0, 1.2), onednn=(1.5, 1.0)))
    assert v.layout == "panels" and v.split == "onednn would be 1.20x faster at prefill rows"


def test_no_split_where_the_regime_winner_only_kept_its_place_by_the_margin():
    # mm 2% faster than panels at decode rows (inside the margin: decode's winner stays panels)
    # and 10% at prefill rows: mm wins overall and loses nothing at decode rows
    v = choose_layout(times(panels=(1.0, 1.0), mm=(0.98, 0.9)))
    assert v.layout == "mm" and v.split is None


def test_a_head_is_decided_by_decode_rows_alone():
    t = times(panels=(1.0, 9.0), onednn=(1.2, 1.0))
    decode_only = {name: {r: s for r, s in by.items() if r in DECODE_ROWS} for name, by in t.items()}
    v = choose_layout(decode_only, DECODE_ROWS, ())
    assert v.layout == "panels" and v.split is None


def test_a_missing_time_is_an_error_not_a_guess():
    t = times(panels=(1.0, 1.0), onednn=(1.0, 1.0))
    del t["onednn"][512]
    with pytest.raises(ValueError, match="onednn@512"):
        choose_layout(t)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAFLEX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(layout_chooser.SWITCH, "1")
    monkeypatch.setattr(layout_chooser, "CHOOSER", LayoutChooser())  # no verdicts from earlier tests
    return tmp_path


def test_a_real_small_shape_is_measured_once_cached_and_read_back(cache, monkeypatch):
    monkeypatch.setattr(layout_chooser, "worth_caching", lambda noise: True)  # cached however busy the machine
    w = torch.randn(48, 40)
    layouts = linear_module.candidate_layouts(w.device, w.dtype)
    build = lambda name, weight: Linear(weight, layout=name)  # noqa: E731
    first = LayoutChooser().choose(layouts, build, w, True, linear_module.LIBRARY.path)
    assert first.layout in layouts and set(first.scores) == set(layouts) and min(first.scores.values()) >= 1.0
    [stored] = (cache / "linear_layouts").iterdir()
    entry = json.loads(stored.read_text())[f"48x40 float32 {'+'.join(layouts)} prefill"]
    assert entry["layout"] == first.layout and set(entry["times"][layouts[0]]) == {str(r) for r in ROWS}
    with mock.patch.object(layout_chooser, "measure", side_effect=AssertionError("measured again")):
        again = LayoutChooser().choose(layouts, build, w, True, linear_module.LIBRARY.path)  # a new process
    assert again == first
    x = torch.randn(5, 40)
    torch.testing.assert_close(Linear(w, layout=first.layout)(x), torch.nn.functional.linear(x, w),
                               rtol=1e-5, atol=1e-5)


def test_a_noisy_measurement_is_used_but_not_cached(cache):
    w = torch.randn(32, 18)
    fake = {"onednn": {r: 1.0 for r in ROWS}, "mm": {r: 2.0 for r in ROWS}}
    build = lambda name, weight: Linear(weight, layout=name)  # noqa: E731
    with mock.patch.object(layout_chooser, "measure", return_value=(fake, 2 * layout_chooser.NOISY_SPREAD)):
        verdict = LayoutChooser().choose(["onednn", "mm"], build, w, True, None)
    assert verdict.layout == "onednn" and not (cache / "linear_layouts").exists()


def test_a_change_of_thread_count_measures_again(cache):
    previous = torch.get_num_threads()
    try:
        keys = set()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            keys.add(layout_chooser.machine_key(linear_module.LIBRARY.path))
    finally:
        torch.set_num_threads(previous)
    assert len(keys) == 2


def test_linear_takes_the_verdict_and_the_switch_turns_the_chooser_off(cache, monkeypatch):
    w = torch.randn(32, 16)
    layouts = linear_module.candidate_layouts(w.device, w.dtype)
    if len(layouts) < 2:
        pytest.skip("one layout only here: nothing to choose")
    last = layouts[-1]
    fake = {name: {r: (1.0 if name == last else 2.0) for r in ROWS} for name in layouts}
    with mock.patch.object(layout_chooser, "measure", return_value=(fake, 0.0)):
        chosen = Linear(w)
    assert chosen.layout == last and chosen.verdict.layout == last
    monkeypatch.setenv(layout_chooser.SWITCH, "0")
    off = Linear(torch.randn(32, 17))
    assert off.layout == layouts[0] and off.verdict is None


def test_chooser_measures_by_default_only_among_openmp_layouts(monkeypatch):
    monkeypatch.delenv(layout_chooser.SWITCH, raising=False)
    assert not layout_chooser.enabled(["panels", "onednn", "mm"])  # mixing pools lost in the step
    assert layout_chooser.enabled(["onednn", "mm"])  # bfloat16 on a native-bf16 CPU
    monkeypatch.setenv(layout_chooser.SWITCH, "1")
    assert layout_chooser.enabled(["panels", "onednn", "mm"])
    monkeypatch.setenv(layout_chooser.SWITCH, "0")
    assert not layout_chooser.enabled(["onednn", "mm"])
