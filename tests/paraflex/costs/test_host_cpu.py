"""The shared host CPU of a `device: cpu` cluster (paraflex/costs/host_cpu.py): busy engines
over a window, the stretch, requests in flight, and the fit recovering a planted demand."""

import pytest

from paraflex.costs.latency_spread import SPREAD_POINTS
from paraflex.costs.host_cpu import (REQUEST_CORES, HostCpu, busy_seconds, engine_timelines, fit_host_cpu,
                                     fit_stretched_latency, in_flight_fn, step_busy_engines)


def test_busy_seconds_is_the_overlap_of_an_engines_intervals_with_the_window():
    flat = [0.0, 1.0, 2.0, 3.0, 5.0, 6.0]
    assert busy_seconds(flat, 0.5, 2.5) == pytest.approx(1.0)  # 0.5 of the first, 0.5 of the second
    assert busy_seconds(flat, 3.0, 5.0) == 0.0
    assert busy_seconds(flat, -1.0, 10.0) == pytest.approx(3.0)
    assert busy_seconds(flat, 5.5, 5.6) == pytest.approx(0.1)
    assert busy_seconds([], 0.0, 1.0) == 0.0


def _step(engine, start, busy, model="a", kind="decode", size=1):
    return {"engine": str(engine), "model": model, "stage": "0", "num_stages": "1", "kind": kind, "batch_size": str(size),
            "prefill_tokens": "0", "total_context": "8", "start_s": str(start), "busy_s": str(busy), "req_ids": ""}


def test_an_engines_back_to_back_steps_are_one_busy_interval():
    timelines = engine_timelines([_step(0, 1.0, 0.5), _step(0, 1.5, 0.5), _step(0, 3.0, 1.0), _step(1, 0.0, 0.1)])
    assert timelines == {"0": [1.0, 2.0, 3.0, 4.0], "1": [0.0, 0.1]}
    # a step of engine 0 at 0.1 s: itself, and engine 1 busy over the whole 20 ms before
    assert step_busy_engines(timelines, "0", 0.1) == pytest.approx(2.0)
    assert step_busy_engines(timelines, "1", 1.01) == pytest.approx(1.5)  # engine 0 over half the window


def test_one_engine_alone_runs_as_profiled_and_two_on_one_core_take_twice_as_long():
    assert HostCpu(cores=2, demand_per_engine=2.0).stretch(1.0) == 1.0
    assert HostCpu(cores=1, demand_per_engine=1.0).stretch(1.0) == 1.0
    assert HostCpu(cores=1, demand_per_engine=1.0).stretch(2.0) == 2.0
    # the other engine's 1 core and 10 requests' 1 core besides the step's own, over 2 cores
    assert HostCpu(cores=2, demand_per_engine=1.0, demand_per_request=0.1).stretch(2.0, in_flight=10) == pytest.approx(2.0)


def test_work_slows_as_soon_as_another_engine_runs_beside_it_with_a_core_to_spare():
    """No idle headroom (the eighth pass): on 2 cores one engine of demand 1 beside the step,
    or half of one, stretches it (a processor-sharing max(1, demand / cores) would give 1.0
    for both, the demand 2 and 1.5 not exceeding the 2 cores), linearly in the busy share."""
    host = HostCpu(cores=2, demand_per_engine=1.0)
    assert host.stretch(1.5) == pytest.approx(1.25)
    assert host.stretch(2.0) == pytest.approx(1.5)
    assert host.stretch(1.0) == 1.0 and host.stretch(0.0) == 1.0  # nothing beside it: never faster than alone
    assert HostCpu(cores=2, demand_per_engine=1.0, demand_per_request=0.1).stretch(1.0, in_flight=4) == pytest.approx(1.2)


def test_requests_in_flight_count_from_the_http_arrival_to_the_finish():
    rows = [{"http_arrival_s": "1.0", "finish_s": "3.0"}, {"http_arrival_s": "2.0", "finish_s": "2.5"},
            {"http_arrival_s": "", "finish_s": "9.0"}]  # not logged over HTTP: not counted
    open_at = in_flight_fn(rows)
    assert [open_at(t) for t in (0.5, 1.5, 2.2, 2.7, 3.5)] == [0, 1, 2, 1, 0]


def _planted(host: HostCpu, base_s: float, in_flight: int = 0) -> list[dict]:
    """Steps of `base_s` each (stage time only, no loop time), stretched by `host` with
    `in_flight` requests open: engine 0 alone for 0.2 s, then both engines back to back for
    0.2 s, generated in start order."""
    steps, ends = [], {"0": 0.0, "1": 1.0}
    while min(ends.values()) < 1.2:
        engine = min(ends, key=ends.get)
        start = ends[engine]
        busy = step_busy_engines(engine_timelines(steps), engine, start) if steps else 1.0
        steps.append(_step(engine, start, base_s * host.stretch(busy, in_flight)))
        ends[engine] = start + float(steps[-1]["busy_s"])
        if engine == "0" and 0.2 <= ends["0"] < 1.0:
            ends["0"] = 1.0  # idle until engine 1 starts
    return steps


def test_the_fit_recovers_a_planted_demand_per_engine():
    planted = HostCpu(cores=2, demand_per_engine=1.5)
    steps = _planted(planted, 0.002)
    host, lines = fit_host_cpu(steps, lambda r: 0.002, cores=2)
    assert host.demand_per_engine == 1.5 and host.demand_per_request == 0.0 and host.steps == len(steps)
    assert lines["a"]["decode_s"] == pytest.approx(0.0, abs=1e-9)  # de-stretched, nothing is left to the loop
    assert max(float(s["busy_s"]) for s in steps) == pytest.approx(0.002 * (1 + 1.5 / 2))  # both engines busy


def test_the_open_requests_take_at_most_request_cores():
    host = HostCpu(cores=2, demand_per_engine=1.0, demand_per_request=0.15)
    assert host.stretch(2.0, in_flight=10) == pytest.approx(1 + (1.0 + 1.5) / 2)
    assert host.stretch(2.0, in_flight=40) == pytest.approx(1 + (1.0 + REQUEST_CORES) / 2)  # not 1 + (1 + 6) / 2
    assert host.stretch(2.0, in_flight=40) == host.stretch(2.0, in_flight=400)


def test_the_fit_keeps_the_open_requests_under_the_cap_it_cannot_see():
    """Steps planted with 0.4 cores per request and no cap, 10 requests open throughout: the fit
    may not choose a demand whose 10 requests pass REQUEST_CORES (0.4 x 10 = 4 > 3)."""
    planted = HostCpu(cores=2, demand_per_engine=1.5, demand_per_request=0.4, request_cores=99.0)
    steps = _planted(planted, 0.002, in_flight=10)
    requests = [{"http_arrival_s": "-1.0", "finish_s": "100.0"}] * 10
    host, _ = fit_host_cpu(steps, lambda r: 0.002, cores=2, requests=requests)
    assert 0 < host.demand_per_request * 10 <= REQUEST_CORES
    unplanted, _ = fit_host_cpu(steps, lambda r: 0.002, cores=2)  # no requests: none counted
    assert unplanted.demand_per_request == 0.0


def test_a_stretched_latency_is_recovered_from_work_logged_quiet_and_busy():
    steps = [_step(0, 0.0, 1.0), _step(1, 0.0, 1.0)]  # both engines busy over [0, 1]
    host = HostCpu(cores=1, demand_per_engine=1.0)
    samples = [(0.5, 0.006), (5.0, 0.003)]  # at 0.5 s two busy engines stretch x2; at 5 s none
    latency, spread = fit_stretched_latency(samples, steps, [], host)
    assert latency == pytest.approx(0.003) and spread == pytest.approx([1.0] * SPREAD_POINTS)  # both 3 ms when quiet
    latency, spread = fit_stretched_latency(samples, steps, [], None)
    assert latency == pytest.approx(0.0045)  # no host: the mean
    assert spread[0] == pytest.approx(2 / 3) and spread[-1] == pytest.approx(4 / 3)  # 3 and 6 ms around it
