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
    assert all(r[4].endswith("%") for r in rows) and rows[0][4] != "0%"  # first-met lengths: the first bin has some
