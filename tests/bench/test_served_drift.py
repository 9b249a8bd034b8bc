"""bench/served_drift.py: the threads' CPU sampled from /proc and the per-bin report of a served
run's step log beside them."""

from __future__ import annotations

import csv
import json
import os
import sys
import time

import pytest
from repo_paths import load_bench

from paraflex.engine.step_log import STEP_LOG_COLUMNS


def test_thread_cores_are_cpu_seconds_between_the_first_and_last_sample_over_their_span():
    bench = load_bench("served_drift")
    rows = [{"t": t, "tid": tid, "name": "python", "cpu_s": cpu}
            for t, tid, cpu in ((0.0, 7, 1.0), (0.0, 8, 0.0), (1.0, 7, 1.5), (1.0, 8, 0.4),
                                (2.0, 7, 1.6), (2.0, 8, 1.2), (9.0, 7, 5.0))]
    main, others = bench.thread_cores(rows, 7, 0.0, 2.5)  # samples at 0 and 2 inside
    assert main == pytest.approx(0.3) and others == pytest.approx(0.6)
    assert all(v != v for v in bench.thread_cores(rows, 7, 5.0, 6.0))  # no two samples: NaN


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_sees_a_busy_thread_of_this_process(tmp_path):
    bench = load_bench("served_drift")
    sampler = bench.ThreadSampler(os.getpid(), str(tmp_path / "threads.csv"), every=0.05)
    end = time.thread_time() + 0.3
    while time.thread_time() < end:  # 0.3 s of the main thread's own CPU (the process's would count other threads')
        pass
    sampler.stop()
    with open(tmp_path / "threads.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    mine = [float(r["cpu_s"]) for r in rows if int(r["tid"]) == os.getpid()]
    assert len(mine) >= 2 and mine[-1] - mine[0] >= 0.1  # CPU seconds grow between samples


def test_the_report_bins_a_step_log_and_says_when_there_is_none(tmp_path):
    bench = load_bench("served_drift")
    assert "no step log" in bench.drift_report(str(tmp_path))
    (tmp_path / "steps").mkdir()
    with open(tmp_path / "steps" / "engine-0.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=STEP_LOG_COLUMNS)
        w.writeheader()
        for i in range(30):  # 30 s of steps, a prefill and a decode per second
            for kind, busy, cpu in (("prefill", 0.010 + (i >= 20) * 0.005, 0.009), ("decode", 0.002, 0.0015)):
                w.writerow({"engine": 0, "model": "m", "stage": 0, "num_stages": 1, "kind": kind, "batch_size": 1,
                            "prefill_tokens": 100 if kind == "prefill" else 0, "total_context": 100,
                            "resident_stages": 1, "crosses": 0, "start_s": 1000.0 + i, "busy_s": busy,
                            "run_s": busy / 2, "cpu_s": cpu, "req_ids": "a"})
    (tmp_path / "threads.json").write_text(json.dumps({"pid": 7}))
    with open(tmp_path / "threads.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(("t", "tid", "name", "cpu_s"))
        for t in range(31):
            w.writerows(((1000.0 + t, 7, "python", 0.2 * t), (1000.0 + t, 9, "python", 0.8 * t)))
    lines = bench.drift_report(str(tmp_path), bin_s=10).splitlines()
    bins = [line.split() for line in lines[2:]]
    assert [b[0] for b in bins] == ["0", "10", "20"]
    assert [float(b[2]) for b in bins] == [10.0, 10.0, 15.0]  # the prefill's median wall time per bin
    assert all(float(b[3]) == 9.0 and float(b[5]) == 2.0 for b in bins)  # its CPU; the decode's wall
    assert all(float(b[7]) == pytest.approx(0.2) and float(b[8]) == pytest.approx(0.8) for b in bins)


def test_host_speeds_compare_each_window_with_the_reference_windows(tmp_path):
    bench = load_bench("served_drift")
    path = tmp_path / "host.csv"
    rows = [(t, 0.002) for t in range(0, 10)] + [(t, 0.004) for t in range(10, 20)]
    rows += [(t, 0.0016) for t in range(20, 30)]
    path.write_text("t,probe_s\n" + "".join(f"{t},{dt}\n" for t, dt in rows))
    windows = {"slow": (10.0, 19.5), "fast": (20.0, 29.5), "none": (50.0, 60.0)}
    speeds = bench.host_speeds(str(path), [(0.0, 9.5)], windows)
    assert speeds == {"slow": pytest.approx(0.5), "fast": pytest.approx(1.25)}  # no probe run in "none"
    assert bench.host_speeds(str(path), [(40.0, 45.0)], {"slow": (10.0, 19.5)}) == {}  # no reference runs
    assert bench.host_speeds(str(tmp_path / "missing.csv"), [(0.0, 9.5)], {"slow": (10.0, 19.5)}) == {}


def test_the_host_probe_runs_in_its_own_process_until_stopped(tmp_path):
    bench = load_bench("served_drift")
    probe = bench.HostProbe(str(tmp_path / "host.csv"), every=0.02)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not (tmp_path / "host.csv").exists()
                                            or len((tmp_path / "host.csv").read_text().splitlines()) < 4):
        time.sleep(0.05)
    probe.stop()
    assert probe.proc.poll() is not None and probe.proc.pid != os.getpid()
    lines = (tmp_path / "host.csv").read_text().splitlines()
    assert lines[0] == "t,probe_s" and len(lines) >= 4
    assert all(float(line.split(",")[1]) > 0 for line in lines[1:])
