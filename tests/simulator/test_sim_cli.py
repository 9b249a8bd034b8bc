"""`paraflex simulate` end to end on a tiny CPU config, and its one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from paraflex.cli import main
from sim_cases import TWO_TINY_MODELS_YAML

CONFIG = TWO_TINY_MODELS_YAML + "workload: {arrival: poisson, num_requests: 30, seed: 0}\n"


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG)
    return p


def test_one_run_writes_results(cfg, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--system", "paraflex", "--rate", "20", "-o", str(out)]) == 0
    for f in ("requests.csv", "summary.json", "config.json", "placement.json", "active_gpus.png", "batch_sizes.png"):
        assert (out / f).is_file(), f
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == summary["requests"] > 0
    rows = (out / "requests.csv").read_text().strip().splitlines()
    assert len(rows) == summary["requests"] + 1
    saved = json.loads((out / "config.json").read_text())
    assert saved["simulation"]["rate"] == 20 and saved["config"]["cluster"]["num_engines"] == 2
    assert "throughput" in capsys.readouterr().out


def test_no_fast_forward_gives_the_same_requests(cfg, tmp_path):
    runs = {}
    for name, extra in (("fast", []), ("slow", ["--no-fast-forward"])):
        out = tmp_path / name
        assert main(["simulate", str(cfg), "--rate", "20", "-o", str(out), *extra]) == 0
        runs[name] = (out / "requests.csv").read_text(), json.loads((out / "summary.json").read_text())
    assert runs["fast"][0] == runs["slow"][0]
    assert runs["slow"][1]["fast_forward_cycles"] == 0 < runs["fast"][1]["fast_forward_cycles"]


def _err(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_unknown_system(cfg, capsys):
    code, err = _err(["simulate", str(cfg), "--system", "nope", "--rate", "1"], capsys)
    assert code == 2 and "unknown system 'nope'" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("rate", ["0", "-3"])
def test_bad_rate(cfg, capsys, rate):
    code, err = _err(["simulate", str(cfg), f"--rate={rate}"], capsys)
    assert code == 2 and "rate must be a finite number > 0" in err


def test_missing_and_malformed_trace(cfg, tmp_path, capsys):
    code, err = _err(["simulate", str(cfg), "--rate", "1", "--trace", str(tmp_path / "no.csv")], capsys)
    assert code == 2 and "not found" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n1,x,5\n")
    code, err = _err(["simulate", str(cfg), "--rate", "1", "--trace", str(bad)], capsys)
    assert code == 2 and "bad.csv:3: malformed row" in err


@pytest.mark.parametrize("arrival", ["poisson", "lognormal"])
def test_workload_flags_reach_the_run(cfg, tmp_path, arrival):
    out = tmp_path / "out"
    argv = ["simulate", str(cfg), "--rate", "20", "-o", str(out), "--arrival", arrival, "--cv", "3",
            "--num-requests", "12", "--prompt-scale", "0.5", "--output-scale", "2", "--zipf-alpha", "0.5"]
    assert main(argv) == 0
    w = json.loads((out / "config.json").read_text())["config"]["workload"]
    assert (w["arrival"], w["cv"], w["num_requests"], w.get("duration_s")) == (arrival, 3, 12, None)
    assert (w["prompt_scale"], w["output_scale"], w["zipf_alpha"]) == (0.5, 2, 0.5)


def test_zipf_flag_reaches_the_planner(cfg, tmp_path):
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--rate", "20", "-o", str(out), "--zipf-alpha", "2", "--num-requests", "10"]) == 0
    rates = json.loads((out / "placement.json").read_text())["params"]["rates"]
    assert rates["a"] == pytest.approx(4 * rates["b"])  # 1 : 1/2^2, not the config's 1 : 1


@pytest.mark.parametrize("flags, message", [
    (["--rate", "inf"], "--rate must be a finite number > 0"),
    (["--rate", "1", "--seed", "-1"], "--seed must be >= 0"),
    (["--rate", "1", "--cv", "inf"], "--cv must be a finite number > 0"),
    (["--rate", "1", "--duration", "inf"], "--duration must be a finite number > 0"),
    (["--rate", "1", "--zipf-alpha", "-1"], "--zipf-alpha must be a finite number > 0"),
    (["--rate", "1", "--zipf-alpha", "2000"], "no requests at all"),
    (["--rate", "1", "--num-requests", "100000000000"], "at most 100,000,000 per run"),
    (["--sweep", "--rates", "1,inf"], "rates must be finite numbers > 0"),
])
def test_bad_workload_values(cfg, capsys, flags, message):
    code, err = _err(["simulate", str(cfg), *flags], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, message", [
    (["--rate", "1", "--rates", "1,2"], "--rates applies to --sweep only"),
    (["--rate", "1", "--systems", "paraflex"], "--systems applies to --sweep only"),
    (["--rate", "1", "--seeds", "3"], "--seeds applies to --sweep only"),
    (["--sweep", "--rates", "1", "--systems", ""], "--systems: give at least one system"),
    (["--sweep", "--rates", "1", "--system", "sarathi"], "--system applies to one run only; with --sweep give --systems"),
    (["--sweep", "--rates", "1", "--rate", "2"], "--rate applies to one run only; with --sweep give --rates"),
])
def test_sweep_flags_belong_to_the_sweep(cfg, capsys, flags, message):
    code, err = _err(["simulate", str(cfg), *flags], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_output_path_that_cannot_be_a_directory(cfg, tmp_path, capsys):
    taken = tmp_path / "afile"
    taken.write_text("")
    for out in (taken, taken / "sub"):
        code, err = _err(["simulate", str(cfg), "--rate", "1", "-o", str(out)], capsys)
        assert code == 2 and "cannot make the results directory" in err
    assert not (tmp_path / "sim-results").exists()


def test_a_run_that_draws_no_request(cfg, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--rate", "5", "--duration", "1e-6", "-o", str(out)]) == 0
    assert "drew 0 requests" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["requests"] == 0
    assert main(["simulate", str(cfg), "--sweep", "--rates", "5", "--systems", "paraflex", "--duration", "1e-6",
                 "--jobs", "1", "-o", str(tmp_path / "sweep")]) == 0
    assert "n/a" in capsys.readouterr().out


def test_huge_prompt_scale_clips_to_the_context(cfg, tmp_path):
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--rate", "5", "--num-requests", "10", "--prompt-scale", "1e30", "-o", str(out)]) == 0
    models = json.loads((out / "summary.json").read_text())["workload"]["models"]
    assert sum(m["clipped"] for m in models.values()) == sum(m["requests"] for m in models.values()) > 0


def test_trace_arrival_needs_a_trace(cfg, capsys):
    code, err = _err(["simulate", str(cfg), "--rate", "1", "--arrival", "trace"], capsys)
    assert code == 2 and "--arrival trace needs a trace" in err


def test_trace_flag_replays_the_trace(cfg, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(f"{i * 0.1},{7 + i},{3 + i % 4}\n" for i in range(40)))
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--rate", "10", "-o", str(out), "--trace", str(trace), "--num-requests", "20"]) == 0
    w = json.loads((out / "config.json").read_text())["config"]["workload"]
    assert w["arrival"] == "trace" and w["trace"] == str(trace)


def test_sweep_needs_valid_rates(cfg, capsys):
    code, err = _err(["simulate", str(cfg), "--sweep", "--rates", "1,0"], capsys)
    assert code == 2 and "rates must be finite numbers > 0" in err


def test_sweep_writes_curves(cfg, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["simulate", str(cfg), "--sweep", "--rates", "5,20", "--systems", "paraflex,sarathi", "--jobs", "1", "-o", str(out)]
    assert main(argv) == 0
    for f in ("sweep.csv", "sweep.json", "config.json", "latency_vs_throughput.png", "per_model.png"):
        assert (out / f).is_file(), f
    rows = (out / "sweep.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4
    data = json.loads((out / "sweep.json").read_text())["results"]
    by = {(r["system"], r["rate"]): r for r in data}
    # the same requests at a given rate for every system; different draws across rates
    assert by[("paraflex", 5.0)]["requests"] == by[("sarathi", 5.0)]["requests"]
    assert by[("paraflex", 5.0)]["seed"] != by[("paraflex", 20.0)]["seed"]


@pytest.mark.parametrize("name, csv", [("splitwise-conv", "splitwise_conv.csv"), ("splitwise-code", "splitwise_code.csv")])
def test_trace_flag_takes_a_shipped_trace_by_name(cfg, tmp_path, name, csv):
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--rate", "10", "-o", str(out), "--trace", name, "--num-requests", "10"]) == 0
    w = json.loads((out / "config.json").read_text())["config"]["workload"]
    assert w["arrival"] == "trace" and w["trace"].endswith(csv)


@pytest.mark.parametrize("flags", [["--rate", "1", "--num-requests", "100000000000"], ["--rate", "1", "--zipf-alpha", "-1"],
                                   ["--sweep", "--rates", "1", "--num-requests", "100000000000"]],
                         ids=["too-many-requests", "bad-zipf", "sweep-too-many-requests"])
def test_a_failed_run_leaves_no_results_folder(cfg, tmp_path, monkeypatch, capsys, flags):
    monkeypatch.chdir(tmp_path)
    code, _ = _err(["simulate", str(cfg), *flags], capsys)
    assert code == 2
    assert not (tmp_path / "sim-results").exists()


def test_seed_system_run_and_min_engines_search(cfg, tmp_path, capsys):
    out = tmp_path / "aeg"
    assert main(["simulate", str(cfg), "--system", "aegaeon", "--rate", "20", "-o", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == summary["requests"] > 0 and summary["switches"] > 0
    assert (out / "switch_latency.png").is_file()
    capsys.readouterr()
    assert main(["simulate", str(cfg), "--system", "muxserve", "--rate", "5", "--find-min-engines", "0.5",
                 "--attainment", "ttft", "--max-engines", "2"]) == 0
    printed = capsys.readouterr().out
    assert "muxserve: 1 engines x 1 GPUs reach ttft attainment >= 0.5" in printed


def test_prefill_engines_out_of_range_is_one_line(cfg, capsys):
    assert main(["simulate", str(cfg), "--system", "aegaeon", "--rate", "5", "--prefill-engines", "2"]) == 2
    assert "--prefill-engines 2: must leave at least one engine" in capsys.readouterr().err
