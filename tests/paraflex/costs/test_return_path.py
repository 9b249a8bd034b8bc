"""The served return path (paraflex/costs/return_path.py): the way back of each logged first
and last token, the latency fitted through them as the shared host CPU stretches it, and the
simulator adding it to every token it records (simulator/core/cluster.py, simulator/metrics/records.py)."""

import pytest

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.host_cpu import HOST_CPU_KEY, HostCpu
from paraflex.costs.return_path import fit_return_path, token_backs
from paraflex.costs.serving_terms import RETURN_PATH_KEY, ReturnPathTerm, return_path, store
from paraflex.errors import UserError
from paraflex.simulator.metrics.records import MetricsStore, ModelSLO
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from paraflex.simulator.workload import SimRequest


def _step(engine, start, busy, kind="decode", rids="", stage=0, stages=1):
    return {"engine": str(engine), "model": "a", "stage": str(stage), "num_stages": str(stages), "kind": kind,
            "start_s": str(start), "busy_s": str(busy), "req_ids": rids}


def _request(rid, first, finish, tokens=4):
    return {"id": rid, "first_token_s": str(first), "finish_s": str(finish), "output_tokens": str(tokens),
            "http_arrival_s": ""}


def test_the_fit_recovers_a_planted_latency_stretched_by_the_host():
    """Requests on engine 0 (their last stage) come back 3 ms x the host's stretch after their
    step; engine 1 is busy before half of them, so the window sees one or two engines (stretch
    1 or 2 on one core, one engine's worth each)."""
    steps, requests = [], []
    for i in range(6):
        t = 1.0 * i
        other = i % 2 == 0  # engine 1 busy over the whole window before this request's steps
        if other:
            steps.append(_step(1, t - 0.1, 0.2))
        steps += [_step(0, t - 0.03, 0.03, "prefill", f"r{i}"), _step(0, t, 0.03, "decode", f"r{i}")]
        back = 0.003 * (2.0 if other else 1.0)  # over the 20 ms before each step end, engine 0 is busy too
        requests.append(_request(f"r{i}", t + back, t + 0.03 + back))
    assert len(token_backs(requests, steps)) == 12
    host = HostCpu(cores=1, demand_per_engine=1.0)
    term = fit_return_path(requests, steps, host)
    assert term.latency_s == pytest.approx(0.003) and term.tokens == 12 and term.delay_s(2.0) == pytest.approx(0.006)
    assert fit_return_path(requests, steps).latency_s == pytest.approx(0.0045)  # no host: the mean way back
    assert fit_return_path([_request("other", 1.0, 2.0)], steps) is None  # no step names it


def test_a_middle_stages_step_is_not_the_way_back():
    steps = [_step(0, 0.0, 0.01, "prefill", "r", stage=0, stages=2), _step(1, 0.02, 0.01, "prefill", "r", 1, 2)]
    assert token_backs([_request("r", 0.035, 0.035, tokens=1)], steps) == [(0.03, pytest.approx(0.005))]


def _config(profile_dir=None) -> Config:
    cluster = {"num_engines": 1, "device": "cpu", "memory_gb": 1}
    if profile_dir:
        cluster["profile_dir"] = str(profile_dir)
    return Config.from_dict({"cluster": cluster, "models": [{"name": "a", "arch": "tiny-2l"}],
                             "scheduler": {"max_batch_size": 8, "block_bytes": 4096}})


def test_the_simulator_adds_the_way_back_to_every_token(tmp_path):
    requests = [SimRequest(i, "a", 0.5 * i, 16, 4) for i in range(4)]
    cost, settings = CostModel("cpu"), SimSettings(rate=1.0)
    layout = build_system(_config(), settings)
    plain = simulate(_config(), settings, layout=layout, requests=requests, cost=cost)
    store(str(tmp_path), RETURN_PATH_KEY, ReturnPathTerm(0.002, 1))
    assert return_path(str(tmp_path)) == ReturnPathTerm(0.002, 1)
    late = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    assert late.summary["fast_forward_cycles"] == 0  # step by step: the delay reads the engines' timeline
    for i in range(4):
        a, b = plain.metrics.requests[i], late.metrics.requests[i]
        assert b.first_token == pytest.approx(a.first_token + 0.002)
        assert b.finish == pytest.approx(a.finish + 0.002) and b.max_tbt == pytest.approx(a.max_tbt)
    store(str(tmp_path), HOST_CPU_KEY, HostCpu(cores=2, demand_per_engine=1.0))
    alone = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    assert alone.metrics.request_rows and [_times(alone, i) for i in range(4)] == [_times(late, i) for i in range(4)]
    store(str(tmp_path), HOST_CPU_KEY, HostCpu(cores=1, demand_per_engine=1.0, demand_per_request=1.0))
    crowded = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    for i in range(4):  # its own open request doubles its prefill step; the way back is up to doubled
        step = late.metrics.requests[i].first_token - late.metrics.requests[i].arrival - 0.002
        b = crowded.metrics.requests[i]
        assert 2 * step + 0.002 < b.first_token - b.arrival <= 2 * step + 0.004 + 1e-9


def _times(result, i):
    r = result.metrics.requests[i]
    return r.first_token, r.finish, r.max_tbt


def test_a_return_path_fitted_before_the_host_term_is_refused_with_the_fix(tmp_path):
    (tmp_path / "profile.json").write_text('{"return_path": {"latency_s": 0.001, "per_busy_engine_s": 0.005, '
                                           '"window_s": 0.02, "tokens": 3}}')
    with pytest.raises(UserError, match="fit it again: paraflex profile CONFIG --gateway-log"):
        return_path(str(tmp_path))


def test_a_token_never_reaches_the_frontend_before_the_requests_previous_one():
    metrics = MetricsStore({"a": ModelSLO(10.0, 0.1)}, 1, 1)
    rec = metrics.add_request(0, "a", 0.0, 4, 3)
    delays = iter([0.05, 0.0, 0.0])  # the way back shrinks faster than time passes
    metrics.token_delay = lambda t: next(delays)
    metrics.tokens([rec], 0.01)
    metrics.tokens([rec], 0.02)
    assert rec.first_token == pytest.approx(0.06) and rec.last_token == pytest.approx(0.06)
    metrics.tokens([rec], 0.1)
    metrics.finish(rec, 0.1)
    assert rec.last_token == rec.finish == pytest.approx(0.1) and list(metrics.tbt["a"]) == pytest.approx([0.0, 0.04])
