"""Measured serving-path terms (paraflex/costs/serving_terms.py): the Ray hop fitted as a link
that replaces the config's between engines of one node, the gateway delay read from a served
request log, and the simulator delaying every request by it (records keep the HTTP arrival)."""

import csv
import json
import math

import pytest

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.serving_terms import (ENGINE_LOOP_KEY, GATEWAY_KEY, HOP_KEY, EngineLoopTerm, GatewayTerm, HopTerm,
                                          engine_loop, measured_hop, read_log, request_delay_s, served_alone, store)
from paraflex.errors import UserError
from paraflex.models.catalog import get_arch
from paraflex.serving.request_log import LOG_COLUMNS
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from paraflex.simulator.workload import SimRequest


def _config(profile_dir=None) -> Config:
    cluster = {"num_engines": 1, "device": "cpu", "memory_gb": 1, "interconnect_latency_us": 50}
    if profile_dir:
        cluster["profile_dir"] = str(profile_dir)
    return Config.from_dict({"cluster": cluster, "models": [{"name": "a", "arch": "tiny-2l"}],
                             "scheduler": {"max_batch_size": 8, "block_bytes": 4096}})


def test_the_hop_is_a_line_through_the_smallest_and_largest_payload():
    hop = HopTerm.fit({"decode1": (0.0012, 1000), "prefill512": (0.0032, 2_001_000), "mid": (0.5, 5000)})
    assert hop.bandwidth_Bps == pytest.approx(1e9)
    assert hop.latency_s == pytest.approx(0.0012 - 1000 / 1e9)
    assert hop.link().transfer_time(1_000_000) == pytest.approx(hop.latency_s + 1e-3)
    flat = HopTerm.fit({"decode1": (0.002, 1000), "prefill512": (0.0019, 2_001_000)})  # noise: no growth
    assert flat.bandwidth_Bps is None and flat.latency_s == 0.002 and math.isinf(flat.link().bandwidth_Bps)


def test_a_measured_hop_replaces_the_configs_link_between_engines(tmp_path):
    assert _config().cluster.interconnect().latency_s == pytest.approx(50e-6)
    store(str(tmp_path), HOP_KEY, HopTerm(0.0015, 2e9, [[1000, 0.0015]]))
    (tmp_path / "profile.json").write_text(json.dumps({**json.loads((tmp_path / "profile.json").read_text()),
                                                       "other": 1}))
    store(str(tmp_path), GATEWAY_KEY, GatewayTerm(0.004, 9))  # keeps the rest of the file
    assert json.loads((tmp_path / "profile.json").read_text())["other"] == 1
    cl = _config(tmp_path).cluster
    assert cl.interconnect().latency_s == 0.0015 and cl.topology().link(0, 0).latency_s == 0.0015
    assert measured_hop(str(tmp_path / "none")) is None and request_delay_s(None) == 0.0


def _log(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=LOG_COLUMNS, restval="0")
        w.writeheader()
        w.writerows(rows)


def test_the_delays_are_medians_over_logged_http_requests(tmp_path):
    _log(tmp_path / "log.csv", [{"arrival_s": 10.010, "http_arrival_s": 10.0, "ttft_s": 0.012},
                                {"arrival_s": 11.03, "http_arrival_s": 11.0, "ttft_s": 0.020},
                                {"arrival_s": 12.02, "http_arrival_s": 12.0, "ttft_s": 0.015},
                                {"arrival_s": 13.0, "http_arrival_s": ""}])
    path = str(tmp_path / "log.csv")
    rows = read_log(path)
    assert len(rows) == 3  # the row without an HTTP arrival is left out
    term = GatewayTerm.from_log(rows, path, engine_ttft_s=[0.002, 0.004, 0.005])
    assert term.delay_s == pytest.approx(0.02) and term.requests == 3
    assert term.engine_path_s == pytest.approx(0.010)  # median of 10, 16, 10 ms
    assert GatewayTerm.from_log(rows, path).engine_path_s == 0.0
    with pytest.raises(UserError, match="--gateway-log .*no row has an http_arrival_s"):
        GatewayTerm.from_log([], path)
    with pytest.raises(UserError, match="--gateway-log .*cannot read it"):
        read_log(str(tmp_path / "missing.csv"))


def test_the_simulator_delays_every_request_by_the_gateway_and_engine_path(tmp_path):
    requests = [SimRequest(i, "a", 0.5 * i, 16, 4) for i in range(4)]
    cost, settings = CostModel("cpu"), SimSettings(rate=1.0)  # (the folder holds no op tables)
    layout = build_system(_config(), settings)
    plain = simulate(_config(), settings, layout=layout, requests=requests, cost=cost)
    store(str(tmp_path), GATEWAY_KEY, GatewayTerm(0.2, 5, engine_path_s=0.05))
    delayed = simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=cost)
    assert delayed.summary["request_delay_s"] == pytest.approx(0.25)
    for i in range(4):
        a, b = plain.metrics.requests[i], delayed.metrics.requests[i]
        assert b.arrival == a.arrival == 0.5 * i  # the record keeps the HTTP arrival
        assert b.first_token - b.arrival == pytest.approx(a.first_token - a.arrival + 0.25)
        assert b.finish - b.arrival == pytest.approx(a.finish - a.arrival + 0.25)


def _row(model, output_tokens, mean_tbt_s):
    return {"model": model, "output_tokens": str(output_tokens), "mean_tbt_s": str(mean_tbt_s)}


def test_the_engine_loop_term_is_the_served_tbt_over_the_alone_one_per_stage_step():
    archs = {"a": get_arch("tiny-2l"), "b": get_arch("tiny-8l"), "c": get_arch("tiny-4l")}
    rows = [_row("a", 8, 0.0021), _row("a", 9, 0.0025), _row("a", 1, 0.0),  # one token: no TBT, left out
            _row("a", 6, 0.0023),
            _row("b", 8, 0.0081), _row("b", 4, 0.0071),  # two stages: the extra per stage step is half
            _row("c", 8, 0.001)]  # served faster than simulated: adds nothing
    alone = [0.0007, 0.0007, 0.0, 0.0007, 0.0043, 0.0043, 0.002]
    term = EngineLoopTerm.fit(rows, alone, {"a": 1, "b": 2, "c": 1}, archs)
    steps = {e["model"]: e["step_s"] for e in term.per_model}
    assert steps["a"] == pytest.approx(0.0016)  # median of 1.4, 1.8, 1.6 ms
    assert steps["b"] == pytest.approx(0.00165)  # median of 1.9, 1.4 ms
    assert steps["c"] == 0.0
    assert term.requests == 6 and term.step_s == pytest.approx(0.0016)  # median of the models: 1.6, 1.65, 0
    assert term.stage_step_s(archs["b"]) == pytest.approx(0.00165)
    assert term.stage_step_s(get_arch("llama-20b")) == term.step_s  # a model not logged: the median
    assert EngineLoopTerm.fit([_row("a", 1, 0.0)], [0.0], {"a": 1}, archs).step_s == 0.0


def test_the_cost_model_adds_the_engine_loop_to_every_stage_step(tmp_path):
    arch = get_arch("tiny-2l")
    bare, looped = CostModel("cpu"), CostModel("cpu")  # (no op tables here; CostModel(profile_dir) reads it so)
    store(str(tmp_path), ENGINE_LOOP_KEY, EngineLoopTerm.fit([_row("a", 8, 0.0031)], [0.0011], {"a": 1}, {"a": arch}))
    assert engine_loop(str(tmp_path)).step_s == pytest.approx(0.002)
    looped.engine_loop = engine_loop(str(tmp_path))
    for layers in (1, 2):  # per stage execution, whatever the stage's share of layers
        assert looped.decode_time(arch, layers, 4, 64) == pytest.approx(bare.decode_time(arch, layers, 4, 64) + 0.002)
        assert looped.prefill_time(arch, layers, 32, last=True) == pytest.approx(
            bare.prefill_time(arch, layers, 32, last=True) + 0.002)
    # a request alone: the simulated TBT grows by the term (one stage), which the fit subtracted
    requests = [SimRequest(0, "a", 0.0, 16, 8)]
    settings = SimSettings(rate=1.0)
    layout = build_system(_config(), settings)
    tbt = [(r.last_token - r.first_token) / (r.tokens - 1) for r in
           (simulate(_config(tmp_path), settings, layout=layout, requests=requests, cost=c).metrics.requests[0]
            for c in (bare, looped))]
    assert tbt[1] == pytest.approx(tbt[0] + 0.002)
    store(str(tmp_path), ENGINE_LOOP_KEY, None)  # dropped: the cost model adds nothing again
    assert engine_loop(str(tmp_path)) is None and engine_loop(None) is None


def test_the_gateway_delay_stretches_only_where_a_quiet_delay_was_fitted():
    stretched = GatewayTerm(0.004, 9, engine_path_s=0.001, quiet_delay_s=0.002)
    assert stretched.delay_s_at(2.5) == pytest.approx(0.005)
    assert stretched.delay_s_at(None) == 0.004  # no host term: the median
    assert GatewayTerm(0.004, 9).delay_s_at(2.5) == 0.004


def test_served_alone_keeps_only_requests_no_other_overlapped():
    rows = [{"id": "a", "arrival_s": "0.0", "finish_s": "1.0"},   # alone
            {"id": "b", "arrival_s": "2.0", "finish_s": "3.5"},   # overlaps c
            {"id": "c", "arrival_s": "3.0", "finish_s": "4.0"},
            {"id": "d", "arrival_s": "5.0", "finish_s": "9.0"},   # holds e inside it
            {"id": "e", "arrival_s": "6.0", "finish_s": "7.0"},
            {"id": "f", "arrival_s": "9.5", "finish_s": "9.8"}]   # alone, after d
    assert [r["id"] for r in served_alone(rows)] == ["a", "f"]
    assert served_alone([]) == []
