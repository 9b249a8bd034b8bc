"""bench/sim_fidelity.py at CI size (--tiny: 3 requests per load, roofline, no hop run): the
served (Ray) and simulated runs both finish every request, and every comparison row carries a
computed relative error, and the server log carries the gateway's HTTP arrival. No timing
assertion: on a shared machine only the pipeline is checked."""

from __future__ import annotations

import csv
import math

import pytest
from repo_paths import load_bench

pytestmark = pytest.mark.slow


def test_tiny_fidelity_run_compares_every_load_and_model(tmp_path, capsys):
    bench = load_bench("sim_fidelity")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--saturation", "20"]) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "fidelity.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["load"] for r in rows} == {"light", "mid", "high"}
    alls = [r for r in rows if r["model"] == "all"]
    assert {(r["metric"], r["stat"]) for r in alls} >= {("TTFT", "median"), ("E2E", "p99"), ("throughput", "req/s")}
    assert all(math.isfinite(float(r["rel_err"])) and float(r["real"]) > 0 for r in alls)
    with open(tmp_path / "served_requests.csv", newline="") as fh:
        logged = list(csv.DictReader(fh))
    assert len(logged) == 9  # 3 loads x 3 requests, logged by the server
    # the gateway stamped each HTTP arrival, before the frontend took the request
    assert all(0 <= float(r["arrival_s"]) - float(r["http_arrival_s"]) < 5 for r in logged)
    for load in ("light", "mid", "high"):
        assert f"{load}: 3/3 logged" in out
    assert (tmp_path / "requests-mid.csv").is_file()
    # every engine logged the batches it ran (serve --step-log): the loop's time holds the forward pass
    steps = {p.name: list(csv.DictReader(p.open(newline=""))) for p in (tmp_path / "steps").glob("engine-*.csv")}
    assert set(steps) == {"engine-0.csv", "engine-1.csv"} and all(steps.values())
    rows = [r for v in steps.values() for r in v]
    assert {r["model"] for r in rows} == {"tiny-2l", "tiny-4l", "tiny-8l"} & {r["model"] for r in logged}
    assert all(float(r["busy_s"]) >= float(r["run_s"]) > 0 for r in rows)
    assert {r["crosses"] for r in rows if r["model"] == "tiny-8l"} <= {"1"}
    # the same served run simulated again, serving nothing: the same comparison from windows.json
    first = (tmp_path / "fidelity.csv").read_text()
    (tmp_path / "fidelity.csv").unlink()
    assert bench.main(["--resimulate", str(tmp_path)]) == 0
    assert "light: 3/3 logged" in capsys.readouterr().out and (tmp_path / "fidelity.csv").read_text() == first


def test_in_process_run_on_random_checkpoints_logs_http_arrivals(tmp_path, capsys):
    """The GPU path's shape on a CPU (`--backend in-process --shapes random-small`): one engine
    holding three random-weight Llama checkpoints written under the results folder, the served
    rows keep their HTTP arrival although the in-process loop thread starts them, the engine logs
    its steps, and the run simulates again from its folder without the weights."""
    bench = load_bench("sim_fidelity")
    assert bench.main(["--tiny", "--backend", "in-process", "--shapes", "random-small", "--out", str(tmp_path),
                       "--saturation", "20"]) == 0
    out = capsys.readouterr().out
    assert "in-process backend, cluster device cpu, 1 engine(s)" in out
    with open(tmp_path / "served_requests.csv", newline="") as fh:
        logged = list(csv.DictReader(fh))
    assert len(logged) == 9 and {r["model"] for r in logged} <= {"llama-1b-shape", "qwen-0.5b-shape",
                                                                   "smollm2-360m-shape"}
    assert all(0 <= float(r["arrival_s"]) - float(r["http_arrival_s"]) < 5 for r in logged)
    steps = list(csv.DictReader((tmp_path / "steps" / "engine-0.csv").open(newline="")))  # in-process step log
    assert steps and all(float(r["busy_s"]) >= float(r["run_s"]) > 0 for r in steps)
    assert all(float(r["cpu_s"]) >= 0 for r in steps)  # the loop thread's own CPU time in the step
    # the server's threads were sampled, and the run printed its steps per time bin beside them
    assert (tmp_path / "threads.csv").is_file() and "served steps over the run" in out
    for weights in tmp_path.glob("checkpoints/*/*.safetensors"):
        weights.unlink()
    first = (tmp_path / "fidelity.csv").read_text()
    assert bench.main(["--resimulate", str(tmp_path)]) == 0
    assert (tmp_path / "fidelity.csv").read_text() == first


def _resimulated(tmp_path, run_name: str) -> dict:
    """The saved served run bench/served-runs/RUN_NAME simulated again (`--resimulate` on a copy):
    (load, metric, stat) -> the all-models relative error."""
    import shutil

    from repo_paths import BENCH

    run = tmp_path / run_name
    shutil.copytree(BENCH / "served-runs" / run_name, run)
    assert load_bench("sim_fidelity").main(["--resimulate", str(run)]) == 0
    with open(run / "fidelity.csv", newline="") as fh:
        return {(r["load"], r["metric"], r["stat"]): float(r["rel_err"]) for r in csv.DictReader(fh) if r["model"] == "all"}


def test_the_h100_run_resimulates_within_target_at_every_load(tmp_path, capsys):
    """The saved served H100 run (bench/served-runs/h100-fidelity: the request log, the request
    lists and the GPU profile fitted on its calibration) simulated again: at light, mid and high
    load the simulated TBT median and the throughput, and at mid and high load the E2E median, stay
    within the issue's targets (docs/simulate.md, "Fidelity on a GPU"); a change to the cost
    model, the engine loop's fit or the scheduler that breaks the GPU calibration fails it."""
    rows = _resimulated(tmp_path, "h100-fidelity")
    assert {load for load, *_ in rows} == {"light", "mid", "high"}
    for load in ("light", "mid", "high"):
        assert abs(rows[(load, "TBT", "median")]) <= 0.10, load
        assert abs(rows[(load, "throughput", "req/s")]) <= 0.05, load
    for load in ("mid", "high"):
        assert abs(rows[(load, "E2E", "median")]) <= 0.10, load


def test_the_h100_run_of_400_requests_per_load_resimulates_within_target_where_it_did(tmp_path):
    """The third session's served H100 run (bench/served-runs/h100-fidelity-400: 400 requests per
    load, the in-process arrival stamped at queueing) simulated again: every cell at light load
    within the issue's targets, the P99s of TTFT, TBT and E2E at mid load and of TTFT at high load,
    and the throughput at every load; the mid and high medians are the documented misses (the
    served engine's steps shortened over the run, after its calibration: docs/simulate.md)."""
    rows = _resimulated(tmp_path, "h100-fidelity-400")
    target = {"median": 0.10, "p99": 0.20, "req/s": 0.05}
    held = [("light", m, s) for m in ("TTFT", "TBT", "E2E") for s in ("median", "p99")]
    held += [("mid", m, "p99") for m in ("TTFT", "TBT", "E2E")] + [("high", "TTFT", "p99")]
    held += [(load, "throughput", "req/s") for load in ("light", "mid", "high")]
    for cell in held:
        assert abs(rows[cell]) <= target[cell[2]], (cell, rows[cell])


def test_the_h200_run_resimulates_within_target_where_it_did(tmp_path):
    """The fourth session's served H200 run (bench/served-runs/h200-fidelity-300: 300 requests per
    load, calibrated after a 90 s warm-in) simulated again: at light load the P99s, the E2E median
    and the throughput, at mid load the TTFT median, the TBT and E2E P99s and the throughput, and
    the throughput at high load within the issue's targets; the rest are the documented misses (the
    host-bound prefill of that machine, whose CPU speed moved by up to 1.7x within a minute:
    docs/simulate.md, "Fidelity on a GPU", fourth session)."""
    rows = _resimulated(tmp_path, "h200-fidelity-300")
    target = {"median": 0.10, "p99": 0.20, "req/s": 0.05}
    held = [("light", m, "p99") for m in ("TTFT", "TBT", "E2E")] + [("light", "E2E", "median")]
    held += [("mid", "TTFT", "median"), ("mid", "TBT", "p99"), ("mid", "E2E", "p99")]
    held += [(load, "throughput", "req/s") for load in ("light", "mid", "high")]
    for cell in held:
        assert abs(rows[cell]) <= target[cell[2]], (cell, rows[cell])


def test_the_cpu_run_of_600_requests_per_load_resimulates_within_target_where_it_did(tmp_path):
    """The fourth session's served CPU run (bench/served-runs/cpu-fidelity-600: Ray backend, two
    engines on a 2-vCPU VM, tiny-8l cut over both, 600 requests per load; its profile holds the
    served hop and the latencies' and steps' spreads) simulated again: at light load every cell
    but the TTFT median, at mid and high load every P99, and the throughput at every load within
    the issue's targets; the rest are the documented misses (docs/simulate.md, "The served hop and
    spread latencies"). A change to the served terms, the shared host CPU or the scheduler that
    breaks the CPU calibration fails it."""
    rows = _resimulated(tmp_path, "cpu-fidelity-600")
    target = {"median": 0.10, "p99": 0.20, "req/s": 0.05}
    held = [("light", m, s) for m in ("TBT", "E2E") for s in ("median", "p99")] + [("light", "TTFT", "p99")]
    held += [(load, m, "p99") for load in ("mid", "high") for m in ("TTFT", "TBT", "E2E")]
    held += [(load, "throughput", "req/s") for load in ("light", "mid", "high")]
    for cell in held:
        assert abs(rows[cell]) <= target[cell[2]], (cell, rows[cell])


def test_warm_in_serves_before_the_calibration_and_the_calibration_follows_it(tmp_path, capsys):
    """`--warm-in S` (profiled, toy shapes on the CPU): the burst, then S seconds at the
    calibration's load, then the lone and the half-load requests; only those two are the
    calibration's rows (gateway.csv), and they all came after the warm-in."""
    bench = load_bench("sim_fidelity")
    assert bench.main(["--backend", "in-process", "--shapes", "random-small", "--requests", "6", "--warm-in", "1",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "warm-in: " in out and out.index("warm-in: ") < out.index("calibration: ")
    # each load window's host speed against the calibration's, from the probe's own process
    assert "host speed against the calibration's" in out and (tmp_path / "calibration.json").is_file()
    with open(tmp_path / "gateway.csv", newline="") as fh:
        calib = list(csv.DictReader(fh))
    assert len(calib) == 8 + 12  # 8 alone, 2 x 6 at half of saturation
    with open(tmp_path / "served_requests.csv", newline="") as fh:
        served = list(csv.DictReader(fh))
    calib_ids = {r["id"] for r in calib}
    before = [float(r["arrival_s"]) for r in served if r["id"] not in calib_ids
              and float(r["arrival_s"]) < min(float(r["arrival_s"]) for r in calib)]
    assert len(before) >= 4 + 8  # the burst's requests and the warm-in's came first
