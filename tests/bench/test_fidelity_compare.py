"""bench/fidelity_compare.py's summary over runs (`sim_fidelity.py --runs K`): each all-models
error per run and in how many runs it meets the issue's target."""

from __future__ import annotations

from repo_paths import load_bench


def _rows(ttft_err, thr_err):
    return [{"load": "light", "model": "all", "metric": "TTFT", "stat": "median", "real": 1.0, "sim": 1.0,
             "rel_err": ttft_err},
            {"load": "light", "model": "tiny-2l", "metric": "TTFT", "stat": "median", "real": 1.0, "sim": 1.0,
             "rel_err": 0.5},  # per model: not in the summary
            {"load": "light", "model": "all", "metric": "throughput", "stat": "req/s", "real": 1.0, "sim": 1.0,
             "rel_err": thr_err}]


def test_the_summary_counts_the_runs_within_each_target(capsys):
    load_bench("fidelity_compare").print_runs([_rows(0.05, 0.01), _rows(-0.25, 0.08)])
    out = capsys.readouterr().out.splitlines()
    ttft = next(line for line in out if "TTFT" in line)
    assert "+5.0%" in ttft and "-25.0%" in ttft and ttft.endswith("1/2")
    assert next(line for line in out if "throughput" in line).endswith("1/2")
    assert out[-1] == "within target (all models), per run: 2/2, 0/2"
