"""Workload generation: rates, CV, Zipf shares, trace replay, scaling, clipping, errors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.config.schema import WorkloadConfig
from paraflex.errors import UserError
from paraflex.simulator.workload import WorkloadModel, generate
from paraflex.simulator.workload.arrivals import lognormal, poisson
from paraflex.simulator.workload.trace import load_trace

TRACE = "/work/shared/data/traces/splitwise_conv.csv"
needs_trace = pytest.mark.skipif(not os.path.isfile(TRACE), reason="shared Splitwise trace not present")


def _models(n=2, ctx=4096):
    return [WorkloadModel(f"m{i}", ctx, 1.0 / n) for i in range(n)]


def test_poisson_rate_and_cv():
    rng = np.random.default_rng(1)
    t, _ = poisson(rng, 50.0, 400.0)
    gaps = np.diff(t)
    assert len(t) / 400.0 == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.1, 3.5])
def test_lognormal_hits_target_cv(cv):
    rng = np.random.default_rng(2)
    t, _ = lognormal(rng, 20.0, 20000.0, cv=cv)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)


def test_zipf_shares_top_model_49_percent():
    w = WorkloadConfig(zipf_alpha=1.01, num_requests=20000)
    models = [SimpleNamespace(name=f"m{i}", rate=1.0) for i in range(4)]
    shares = dict(zip([m.name for m in models], w.model_shares(models)))
    assert shares["m0"] == pytest.approx(0.48, abs=0.01)
    reqs, info = generate([WorkloadModel(m, 4096, s) for m, s in shares.items()], w, 10.0, 0)
    counts = {m: sum(1 for r in reqs if r.model == m) for m in shares}
    assert counts["m0"] / len(reqs) == pytest.approx(shares["m0"], abs=0.02)
    assert counts["m0"] > counts["m1"] > counts["m2"] > counts["m3"]


def test_same_seed_same_requests_and_ids_in_arrival_order():
    w = WorkloadConfig(arrival="lognormal", cv=3.0, num_requests=500)
    a, _ = generate(_models(3), w, 5.0, 7)
    b, _ = generate(_models(3), w, 5.0, 7)
    c, _ = generate(_models(3), w, 5.0, 8)
    assert [(r.model, r.arrival, r.prompt_len, r.output_len) for r in a] == [(r.model, r.arrival, r.prompt_len, r.output_len) for r in b]
    assert [r.arrival for r in a] != [r.arrival for r in c]
    assert [r.id for r in a] == list(range(len(a)))
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))


def test_builtin_lengths_match_section_2_1():
    w = WorkloadConfig(num_requests=20000)
    reqs, _ = generate(_models(1, ctx=100_000), w, 100.0, 3)
    out = np.array([r.output_len for r in reqs])
    cut = np.percentile(out, 90)
    # 90% short (mean 59), 10% long (mean 478): overall mean ~ 101
    assert out.mean() == pytest.approx(0.9 * 59 + 0.1 * 478, rel=0.1)
    assert out[out > cut].mean() > 4 * out[out <= cut].mean()


@settings(max_examples=25, deadline=None)
@given(ps=st.floats(0.25, 4), os_=st.floats(0.25, 4), ctx=st.integers(64, 4096))
def test_scaling_and_context_clip(ps, os_, ctx):
    base, _ = generate(_models(1, ctx=10**9), WorkloadConfig(num_requests=200), 10.0, 5)
    scaled, info = generate(_models(1, ctx=ctx), WorkloadConfig(num_requests=200, prompt_scale=ps, output_scale=os_), 10.0, 5)
    assert len(base) == len(scaled)
    for a, b in zip(base, scaled):
        assert b.prompt_len + b.output_len <= ctx and b.prompt_len >= 1 and b.output_len >= 1
        if round(a.prompt_len * ps) + round(a.output_len * os_) < ctx:
            assert b.prompt_len == max(1, round(a.prompt_len * ps)) and b.output_len == max(1, round(a.output_len * os_))


@needs_trace
def test_trace_replay_rate_offsets_and_lengths():
    tr = load_trace(TRACE)
    w = WorkloadConfig(arrival="trace", trace=TRACE, num_requests=4000)
    reqs, info = generate(_models(2, ctx=100_000), w, 20.0, 0)
    assert info["requests"] == pytest.approx(4000, rel=0.35)  # the trace is bursty over a window
    rows = set(zip(tr.prompt.tolist(), tr.output.tolist()))
    assert all((r.prompt_len, r.output_len) in rows for r in reqs)
    firsts = [next(r for r in reqs if r.model == m) for m in ("m0", "m1")]
    assert (firsts[0].prompt_len, firsts[0].output_len) != (firsts[1].prompt_len, firsts[1].output_len)  # random offsets


def test_malformed_and_missing_traces(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,ten,5\n")
    with pytest.raises(UserError, match=r"bad.csv:3: malformed row"):
        load_trace(str(bad))
    hdr = tmp_path / "hdr.csv"
    hdr.write_text("time,prompt\n0,1\n")
    with pytest.raises(UserError, match="header lacks"):
        load_trace(str(hdr))
    neg = tmp_path / "neg.csv"
    neg.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,0,5\n")
    with pytest.raises(UserError, match="integer token counts >= 1"):
        load_trace(str(neg))
    with pytest.raises(UserError, match="cannot open"):
        load_trace(str(tmp_path / "nope.csv"))


def test_rate_must_be_positive():
    with pytest.raises(UserError, match="rate must be > 0"):
        generate(_models(1), WorkloadConfig(), 0.0, 0)
