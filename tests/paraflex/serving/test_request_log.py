"""`paraflex serve --request-log` (paraflex/serving/request_log.py): the frontend's per-request
rows in the simulator's requests.csv columns, for finished requests only; the in-process
backend end to end (the Ray backend's is in test_ray_serving.py)."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest

from gateway_cluster import make_config, make_placement
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.serving.frontend import Frontend
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.request_log import HTTP_ARRIVAL, LOG_COLUMNS, RequestLog
from paraflex.simulator.metrics.records import REQUEST_COLUMNS


class Engines:
    def add_request(self, *args):
        pass

    def free(self, *args):
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == LOG_COLUMNS and LOG_COLUMNS[:len(REQUEST_COLUMNS)] == REQUEST_COLUMNS
        return list(reader)


def test_rows_carry_the_simulators_columns_and_times(tmp_path):
    placement = SimpleNamespace(models={"m": SimpleNamespace(replicas=[[0, 1], [2]])})
    models = [SimpleNamespace(name="m", slo_ttft_ms=300, slo_tbt_ms=100)]
    clock = Clock()
    log = RequestLog(str(tmp_path / "log.csv"), models, clock=clock)
    f = Frontend(None, placement, Engines(), report=lambda line: None)
    f.request_log = log
    f.start("a", "m", [1, 2, 3], SamplingParams(max_tokens=3), None)
    f.start("b", "m", [1], SamplingParams(max_tokens=5), None)
    clock.now = 100.2
    f.on_output("a", [7], None, None)
    clock.now = 100.25
    f.on_output("a", [8], None, None)
    clock.now = 100.55  # token 2 is due at 100 + 0.3 + 2 x 0.1: late
    f.on_output("a", [9], "length", None)
    f.end("b", "client went away")  # aborted: no row
    log.close()
    (row,) = _rows(tmp_path / "log.csv")
    assert (row["id"], row["model"], row["replica"], row["prompt_tokens"], row["output_tokens"]) == ("a", "m", "0", "3", "3")
    got = {k: float(row[k]) for k in ("arrival_s", "first_token_s", "finish_s", "e2e_s", "ttft_s", "mean_tbt_s", "max_tbt_s")}
    assert got == pytest.approx({"arrival_s": 100.0, "first_token_s": 100.2, "finish_s": 100.55, "e2e_s": 0.55,
                                 "ttft_s": 0.2, "mean_tbt_s": 0.175, "max_tbt_s": 0.3})
    assert row["tokens_on_time"] == "2"
    assert row["http_arrival_s"] == ""  # not started by the gateway
    assert log.written == 1 and not log.store.requests and not log.http_arrival


def _logged_frontend(tmp_path):
    """(clock, log, frontend): one model "m" on one engine, its requests logged at the clock's times."""
    clock = Clock()
    log = RequestLog(str(tmp_path / "log.csv"), [SimpleNamespace(name="m", slo_ttft_ms=None, slo_tbt_ms=None)],
                     clock=clock)
    f = Frontend(None, SimpleNamespace(models={"m": SimpleNamespace(replicas=[[0]])}), Engines(),
                 report=lambda line: None)
    f.request_log = log
    return clock, log, f


def test_the_gateways_http_arrival_is_logged_with_the_request_it_started(tmp_path):
    clock, log, f = _logged_frontend(tmp_path)
    token = HTTP_ARRIVAL.set(99.98)  # as the gateway's handler sets it, 20 ms before the frontend
    try:
        f.start("a", "m", [1], SamplingParams(max_tokens=1), None)
    finally:
        HTTP_ARRIVAL.reset(token)
    f.start("b", "m", [1], SamplingParams(max_tokens=1), None)  # outside a handler
    clock.now = 100.1
    f.on_output("a", [7], "length", None)
    f.on_output("b", [7], "length", None)
    log.close()
    rows = {r["id"]: r for r in _rows(tmp_path / "log.csv")}
    assert float(rows["a"]["arrival_s"]) - float(rows["a"]["http_arrival_s"]) == pytest.approx(0.02)
    assert rows["b"]["http_arrival_s"] == ""


def test_a_request_queued_for_the_loop_thread_arrives_when_it_was_queued(tmp_path):
    """The in-process backend queues a request (`awaiting`) for its loop thread, which starts it
    after the engine step in progress: that wait is the engines' queue, so the arrival (and the
    gateway's share, arrival - HTTP arrival) stops at the queueing, and TTFT counts the wait."""
    clock, log, f = _logged_frontend(tmp_path)
    token = HTTP_ARRIVAL.set(99.998)
    try:
        log.awaiting("a")  # 2 ms after the HTTP arrival
        log.awaiting("gone")
    finally:
        HTTP_ARRIVAL.reset(token)
    clock.now = 100.015  # the loop thread takes it after a 15 ms step
    f.start("a", "m", [1], SamplingParams(max_tokens=1), None)
    log.dropped("gone")  # never started: nothing of it is kept
    clock.now = 100.04
    f.on_output("a", [7], "length", None)
    log.close()
    (row,) = _rows(tmp_path / "log.csv")
    assert float(row["arrival_s"]) == pytest.approx(100.0)
    assert float(row["arrival_s"]) - float(row["http_arrival_s"]) == pytest.approx(0.002)
    assert float(row["ttft_s"]) == pytest.approx(0.04)
    assert not log.queued_at and not log.http_arrival


def test_an_unwritable_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--request-log .*cannot write it"):
        RequestLog(str(tmp_path / "no" / "such" / "dir.csv"), [])


def test_in_process_cluster_logs_every_finished_request(tmp_path):
    config = make_config()
    cluster = LLMCluster(config, make_placement())
    log = RequestLog(str(tmp_path / "log.csv"), config.models)
    cluster.frontend.request_log = log
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = cluster.generate("tiny-4l", [[1, 2, 3], [4, 5, 6, 7, 8]], params)
    log.close()
    rows = _rows(tmp_path / "log.csv")
    assert len(rows) == 2 and all(len(o.token_ids) == 4 for o in outs)
    assert sorted(int(r["prompt_tokens"]) for r in rows) == [3, 5]
    for r in rows:
        assert float(r["arrival_s"]) <= float(r["first_token_s"]) <= float(r["finish_s"])
        assert float(r["e2e_s"]) >= float(r["ttft_s"]) > 0 and r["output_tokens"] == "4"
