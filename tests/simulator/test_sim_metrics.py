"""Metric definitions: active-GPU share per bin, SLO token deadlines, throughput, TBT gaps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.simulator.metrics.records import MetricsStore, ModelSLO


def test_active_share_matches_brute_force_overlap():
    m = MetricsStore({"x": ModelSLO(1, 1)}, 3, 8)
    rng = np.random.default_rng(0)
    for e in range(3):
        t = 0.0
        for _ in range(50):
            t += rng.exponential(1.0)
            d = rng.exponential(0.7)
            m.batch(e, t, t + d, False, 1, 1)
            t += d
    rec = m.add_request(0, "x", 0.0, 1, 1)
    rec.finish = 120.0
    edges, share = m.active_share(bins=37)
    width = edges[1] - edges[0]
    brute = []
    for a in edges:
        total = 0.0
        for b in m.busy:
            iv = np.frombuffer(b).reshape(-1, 2)
            total += np.clip(np.minimum(iv[:, 1], a + width) - np.maximum(iv[:, 0], a), 0, None).sum()
        brute.append(total / (width * 3))
    assert np.allclose(share, brute)
    assert ((share >= 0) & (share <= 1 + 1e-12)).all()


def test_tokens_deadlines_throughput_and_tbt():
    m = MetricsStore({"a": ModelSLO(0.5, 0.1), "b": ModelSLO(10, 10)}, 1, 1)
    r0 = m.add_request(0, "a", 0.0, 10, 3)
    for t in (0.4, 0.5, 0.9):  # deadlines 0.5, 0.6, 0.7 -> third is late
        m.tokens([r0], t)
    m.finish(r0, 0.9)
    r1 = m.add_request(1, "b", 1.0, 10, 2)
    for t in (2.0, 3.0):
        m.tokens([r1], t)
    m.finish(r1, 3.0)
    s = m.summary()
    assert s["finished"] == 2 and s["span_s"] == pytest.approx(3.0)
    assert s["throughput_rps"] == pytest.approx(2 / 3.0) and s["throughput_tok_s"] == pytest.approx(5 / 3.0)
    assert s["slo_attainment"] == pytest.approx(4 / 5)
    assert s["goodput_rps"] == pytest.approx(1 / 3.0)  # only r1 met every deadline
    assert s["per_model"]["a"]["tbt_p99_s"] == pytest.approx(np.percentile([0.1, 0.4], 99))
    assert s["e2e_median_s"] == pytest.approx(np.median([0.9, 2.0]))
    rows = list(m.request_rows())
    assert rows[0][0] == "id" and rows[1][-1] == 2 and rows[2][-1] == 2


@settings(max_examples=80, deadline=None)
@given(arrival=st.floats(0, 5), ttft=st.floats(0.01, 2), tbt=st.floats(0.001, 0.5),
       before=st.integers(0, 3), gaps=st.lists(st.floats(0, 0.6), min_size=1, max_size=40), recs=st.integers(1, 3))
def test_token_steps_equal_one_token_at_a_time(arrival, ttft, tbt, before, gaps, recs):
    """The replay's bulk recording leaves the same records and the same TBT multiset as
    recording its token times one by one (the on-time shortcut included)."""
    stores = [MetricsStore({"x": ModelSLO(ttft, tbt)}, 1, 1) for _ in range(2)]
    t = arrival
    earlier, times = [], []
    for _ in range(before):
        t += 0.05
        earlier.append(t)
    for g in gaps:
        t += g
        times.append(t)
    for m in stores:
        rs = [m.add_request(i, "x", arrival, 1, 100) for i in range(recs)]
        for e in earlier:
            m.tokens(rs, e)
    stores[0].token_steps(list(stores[0].requests.values()), times)
    for x in times:
        stores[1].tokens(list(stores[1].requests.values()), x)
    fields = ("first_token", "last_token", "tokens", "on_time", "max_tbt")
    for a, b in zip(stores[0].requests.values(), stores[1].requests.values()):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert sorted(stores[0].tbt["x"]) == sorted(stores[1].tbt["x"])
