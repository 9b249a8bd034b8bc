"""The served return path (paraflex/costs/return_path.py): busy engines over a window, the
way back of each logged first and last token, the line fitted through them, and the simulator
adding it to every token it records (simulator/core/cluster.py, simulator/metrics/records.py)."""

import pytest

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.return_path import busy_seconds, engine_timelines, fit_return_path, token_backs
from paraflex.costs.serving_terms import RETURN_PATH_KEY, ReturnPathTerm, return_path, store
from paraflex.simulator.metrics.records import MetricsStore, ModelSLO
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from paraflex.simulator.workload import SimRequest


def test_busy_seconds_is_the_overlap_of_an_engines_intervals_with_the_window():
    flat = [0.0, 1.0, 2.0, 3.0, 5.0, 6.0]
    assert busy_seconds(flat, 0.5, 2.5) == pytest.approx(1.0)  # 0.5 of the first, 0.5 of the second
    assert busy_seconds(flat, 3.0, 5.0) == 0.0
    assert busy_seconds(flat, -1.0, 10.0) == pytest.approx(3.0)
    assert busy_seconds(flat, 5.5, 5.6) == pytest.approx(0.1)
    assert busy_seconds([], 0.0, 1.0) == 0.0


def _step(engine, start, busy, kind="decode", rids="", stage=0, stages=1):
    return {"engine": str(engine), "model": "a", "stage": str(stage), "num_stages": str(stages), "kind": kind,
            "start_s": str(start), "busy_s": str(busy), "req_ids": rids}


def test_an_engines_back_to_back_steps_are_one_busy_interval():
    timelines = engine_timelines([_step(0, 1.0, 0.5), _step(0, 1.5, 0.5), _step(0, 3.0, 1.0), _step(1, 0.0, 0.1)])
    assert sorted(timelines) == [[0.0, 0.1], [1.0, 2.0, 3.0, 4.0]]


def _request(rid, first, finish, tokens=4):
    return {"id": rid, "first_token_s": str(first), "finish_s": str(finish), "output_tokens": str(tokens)}


def test_the_fit_recovers_a_planted_line_in_the_busy_engines():
    """Requests on engine 0 (their last stage) come back 1 ms + 3 ms per busy engine after their
    step; engine 1 is busy before half of them, so the window sees one or two engines."""
    steps, requests = [], []
    for i in range(6):
        t = 1.0 * i
        other = i % 2 == 0  # engine 1 busy over the whole window before this request's steps
        if other:
            steps.append(_step(1, t - 0.1, 0.2))
        steps += [_step(0, t - 0.03, 0.03, "prefill", f"r{i}"), _step(0, t, 0.03, "decode", f"r{i}")]
        busy = 2.0 if other else 1.0  # over the 20 ms before each step end, engine 0 is busy too
        back = 0.001 + 0.003 * busy
        requests.append(_request(f"r{i}", t + back, t + 0.03 + back))
    assert len(token_backs(requests, steps)) == 12
    term = fit_return_path(requests, steps)
    assert term.latency_s == pytest.approx(0.001, abs=1e-6) and term.per_busy_engine_s == pytest.approx(0.003)
    assert term.tokens == 12 and term.delay_s(2.0) == pytest.approx(0.007)
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
    store(str(tmp_path), RETURN_PATH_KEY, ReturnPathTerm(0.002, 0.0, 0.02, 1))
    assert return_path(str(tmp_path)) == ReturnPathTerm(0.002, 0.0, 0.02, 1)
    late = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    assert late.summary["fast_forward_cycles"] == 0  # step by step: the delay reads the engines' timeline
    for i in range(4):
        a, b = plain.metrics.requests[i], late.metrics.requests[i]
        assert b.first_token == pytest.approx(a.first_token + 0.002)
        assert b.finish == pytest.approx(a.finish + 0.002) and b.max_tbt == pytest.approx(a.max_tbt)
    store(str(tmp_path), RETURN_PATH_KEY, ReturnPathTerm(0.002, 0.01, 0.02, 1))
    busy = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    for i in range(4):  # the engine ran the request's step just before: 2 ms + up to 10 ms
        a, b = plain.metrics.requests[i], busy.metrics.requests[i]
        assert a.first_token + 0.002 < b.first_token <= a.first_token + 0.012 + 1e-9


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
