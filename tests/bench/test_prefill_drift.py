"""bench/prefill_drift.py on a CPU: the toy shapes through the same path a GPU run takes."""

from __future__ import annotations

import sys

from repo_paths import load_bench


def test_a_short_cpu_run_prints_a_bin_per_interval_with_every_prefill_counted(tmp_path, monkeypatch, capsys):
    bench = load_bench("prefill_drift")
    monkeypatch.setattr(sys, "argv", ["prefill_drift.py", "--small", "--seconds", "1.5", "--bin", "0.5",
                                      "--lengths", "8-40", "--out", str(tmp_path)])
    assert bench.main() == 0
    out = capsys.readouterr().out
    total = int(out.split(" prefills;")[0].split()[-1])
    rows = [line.split() for line in out.splitlines() if line[:1] == " " and "-" in line.split()[0]]
    assert len(rows) >= 3  # one per half second that had a call
    assert sum(int(r[1]) for r in rows) == total > 0
    assert all(r[6].endswith("%") for r in rows) and rows[0][6] != "0%"  # first-met lengths: the first bin has some
    # each call's own CPU time over its wall time, and the pure-Python control against its run median
    assert all(0 < float(r[4]) <= 1.5 and float(r[5]) > 0 for r in rows)
    assert "control (a fixed pure-Python workload after each call): median" in out


def test_profile_calls_prints_the_functions_with_the_most_own_time(tmp_path, monkeypatch, capsys):
    bench = load_bench("prefill_drift")
    monkeypatch.setattr(sys, "argv", ["prefill_drift.py", "--small", "--seconds", "0.5", "--bin", "0.5",
                                      "--lengths", "8-40", "--profile-calls", "6", "--out", str(tmp_path)])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "cProfile of 6 prefills (own time, the 25 largest):" in out
    assert "tottime" in out and "engine_loop.py" in out
