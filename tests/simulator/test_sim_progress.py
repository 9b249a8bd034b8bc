"""Progress output of one simulation: running the event loop in slices of simulated time (to
report between them) gives exactly the run of one call, the reports add up, and the status
line stays quiet on short runs, rewrites itself on a terminal and prints lines into a log."""

from __future__ import annotations

import dataclasses
import io
import os

import pytest


from paraflex.config.schema import WorkloadConfig, load_config
from paraflex.simulator.progress import RunProgress
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import build_system
from repo_paths import CONFIGS
from sim_cases import ring_config, ring_layout

TIMING = ("wall_s", "setup_wall_s", "sim_requests_per_wall_s")


def _both(cfg, layout, settings):
    calls = []
    reported = simulate(cfg, settings, layout=layout, progress=lambda *a: calls.append(a))
    plain = simulate(cfg, settings, layout=layout)
    assert list(reported.metrics.request_rows()) == list(plain.metrics.request_rows())
    strip = lambda s: {k: v for k, v in s.items() if k not in TIMING}  # noqa: E731
    assert strip(reported.summary) == strip(plain.summary)
    return reported, calls


def _check_calls(calls, result):
    s = result.summary
    assert len(calls) > 20  # reported along the way, not once at the end
    times, finished, totals, events = zip(*calls)
    assert list(times) == sorted(times) and list(finished) == sorted(finished) and list(events) == sorted(events)
    assert set(totals) == {s["requests"]}
    assert (finished[-1], events[-1]) == (s["finished"], s["events"]) and 0 < finished[len(calls) // 2] < s["finished"]


@pytest.mark.parametrize("seed,policy,fast_forward", [(0, "full-batch-first", True), (1, "prefill-first", False),
                                                      (2, "sarathi", True)])
def test_slices_give_the_run_of_one_call_on_ring_pipelines(seed, policy, fast_forward):
    w = WorkloadConfig(arrival="lognormal", cv=3.0, num_requests=80, seed=seed, output_scale=1.0)
    cfg = ring_config(0.02, policy, 8, w)
    result, calls = _both(cfg, ring_layout(cfg, policy),
                          SimSettings(system="ring", rate=60.0, seed=seed, fast_forward=fast_forward))
    _check_calls(calls, result)


def test_slices_give_the_run_of_one_call_with_the_joint_replay():
    """The §8.2 base case: a 3-stage pipeline with one-stage replicas on its engines, replayed
    jointly (its replays run past the loop's clock, across slice ends)."""
    cfg = load_config(str(CONFIGS / "paper-base.yaml"))
    cfg.workload = dataclasses.replace(cfg.workload, duration_s=None, num_requests=300)
    result, calls = _both(cfg, build_system(cfg, SimSettings(system="paraflex")),
                          SimSettings(system="paraflex", rate=4.0, seed=0))
    assert result.summary["fast_forward_cycles"] > 0
    _check_calls(calls, result)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_into_a_log_quiet_first_then_every_ten_seconds():
    clock, out = FakeClock(), io.StringIO()
    p = RunProgress("sarathi", stream=out, clock=clock)
    for t in (0.5, 1.9, 2.5, 5.0, 12.4, 12.6):
        clock.t = t
        p(t * 3, int(t), 100, int(t * 1000))
    p.close()
    assert out.getvalue().splitlines() == [
        "sarathi: 2/100 requests finished, simulated 7.5 s, 2500 events, 2 s wall",
        "sarathi: 12/100 requests finished, simulated 37.8 s, 12600 events, 13 s wall",  # 12.4 s: 9.9 s after the first
    ]


def test_status_line_on_a_terminal_rewrites_itself_and_is_cleared():
    clock, out = FakeClock(), Terminal()
    p = RunProgress("paraflex", stream=out, clock=clock)
    for t in (2.0, 2.2, 2.6):
        clock.t = t
        p(t, 1, 9, 5)
    p.close()
    writes = out.getvalue().split("\r")
    assert [w.strip() for w in writes if w.strip()] == [
        "paraflex: 1/9 requests finished, simulated 2.0 s, 5 events, 2 s wall",
        "paraflex: 1/9 requests finished, simulated 2.6 s, 5 events, 3 s wall",
    ]
    assert out.getvalue().endswith("\r") and "\n" not in out.getvalue()


def test_a_short_run_prints_nothing():
    out = io.StringIO()
    p = RunProgress("paraflex", stream=out)
    p(1.0, 1, 1, 10)
    p.close()
    assert out.getvalue() == ""
