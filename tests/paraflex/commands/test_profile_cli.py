"""`paraflex profile`: measured op tables in Vidur's layout that the cost model and planner use."""

import json
from pathlib import Path

import pytest
import yaml

from paraflex.cli import main
from paraflex.config.schema import Config, load_config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.latency_spread import SPREAD_POINTS
from paraflex.placement import Placement
from paraflex.costs.profile_tables import ALL_OPS, ProfileIndex
from repo_paths import CONFIGS

CONFIGS = CONFIGS
DEMO, BASE = str(CONFIGS / "demo.yaml"), str(CONFIGS / "paper-base.yaml")


def test_profile_writes_tables_the_cost_model_and_planner_use(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", DEMO, "-o", str(out), "--models", "tiny-2l,tiny-4l", "--tokens", "4,1",
                 "--repeats", "2", "-q", "--no-hop"]) == 0
    assert "cluster.profile_dir" in capsys.readouterr().out
    meta = json.loads((out / "profile.json").read_text())
    assert meta["tokens"] == [1, 4] and meta["repeats"] == 2
    assert {t["model"] for t in meta["tables"]} == {"tiny-2l", "tiny-4l"}
    config = load_config(DEMO)
    index = ProfileIndex(str(out))
    for name in ("tiny-2l", "tiny-4l"):
        arch = config.model(name).arch
        table = index.lookup("cpu", arch, 1)
        assert table is not None and table.num_tokens == [1, 4]
        assert set(table.times) == set(ALL_OPS)
        assert all(t > 0 for times in table.times.values() for t in times)
        model = CostModel("cpu", profile_dir=str(out))
        assert model.linear_time(arch, 4) == pytest.approx(table.layer_time(4) + table.op_time("add", 4))
        assert model.linear_time(arch, 4) != CostModel("cpu").linear_time(arch, 4)  # not the roofline
    # whole served steps: a residual per model, added pro rata to the stage's layers
    steps = {o["model"]: o for o in meta["step_overheads"]}
    noise = meta["noise"]  # the rounds' spread and what was re-measured / pooled, per model
    assert set(noise["ops"]) == set(noise["steps"]) == {"tiny-2l", "tiny-4l"}
    assert noise["ops"]["tiny-2l"]["spread"] >= 0 and noise["steps"]["tiny-4l"]["decode_spread"] >= 0
    for table in (ProfileIndex(str(out)).lookup("cpu", config.model(n).arch, 1) for n in ("tiny-2l", "tiny-4l")):
        assert all(a <= b for op in ALL_OPS for a, b in zip(table.times[op], table.times[op][1:]))  # monotone
    assert set(steps) == {"tiny-2l", "tiny-4l"} and steps["tiny-4l"]["num_layers"] == 4
    arch = config.model("tiny-4l").arch
    tables_only = CostModel("cpu", profile_dir=str(out))
    tables_only.overheads = None
    added = max(0.0, steps["tiny-4l"]["decode_s"] + 3 * steps["tiny-4l"]["decode_per_seq_s"]) / 2  # batch 3
    assert CostModel("cpu", profile_dir=str(out)).decode_time(arch, 2, 3, 30) == pytest.approx(
        tables_only.decode_time(arch, 2, 3, 30) + added)
    raw = yaml.safe_load(Path(DEMO).read_text())
    raw["cluster"]["profile_dir"] = str(out)
    cfg = tmp_path / "demo-profiled.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(cfg), "-o", str(tmp_path / "p.json"), "-q"]) == 0
    assert Placement.load(tmp_path / "p.json").models.keys() == {m.name for m in config.models}


@pytest.mark.parametrize("argv,message", [
    (["--models", "nope"], "'nope' is not a model of the config"),
    (["--tokens", "1,x"], "--tokens"),
    (["--tokens", "0"], "token counts >= 1"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    assert main(["profile", DEMO, "-o", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_gpu_config_is_not_profiled_on_a_cpu(tmp_path, capsys):
    assert main(["profile", BASE, "-o", str(tmp_path), "--device", "cpu"]) == 2
    assert "cluster.device is 'a100-80g'" in capsys.readouterr().err


def test_profile_measures_the_hop_and_a_served_log_gives_the_request_delays(tmp_path, capsys, ray_session):
    """The hop through RayTransport (on the session's Ray) becomes the link between engines;
    `--gateway-log` adds the gateway and frontend <-> engines delays of the logged requests."""
    out = tmp_path / "prof"
    assert main(["profile", DEMO, "-o", str(out), "--models", "tiny-2l", "--tokens", "1,8", "--repeats", "1",
                 "--no-steps", "-q"]) == 0
    hop = json.loads((out / "profile.json").read_text())["hop"]
    assert 0 < hop["latency_s"] < 1 and len(hop["points"]) == 2
    raw = yaml.safe_load(Path(DEMO).read_text())
    raw["cluster"]["profile_dir"] = str(out)
    assert Config.from_dict(raw).cluster.interconnect().latency_s == hop["latency_s"]
    log = tmp_path / "log.csv"
    log.write_text("id,model,replica,arrival_s,prompt_tokens,output_tokens,first_token_s,finish_s,e2e_s,ttft_s,"
                   "mean_tbt_s,max_tbt_s,tokens_on_time,http_arrival_s\n"
                   "a,tiny-2l,0,100.004,8,2,100.5,100.6,0.6,0.496,0.1,0.1,2,100.0\n")
    assert main(["profile", DEMO, "--gateway-log", str(log), "-o", str(out)]) == 0
    assert "gateway 4.00 ms" in capsys.readouterr().out
    meta = json.loads((out / "profile.json").read_text())
    assert meta["hop"] == hop  # the rest of the file is kept
    assert meta["gateway"]["delay_s"] == pytest.approx(0.004) and 0.3 < meta["gateway"]["engine_path_s"] < 0.496
    loop = meta["engine_loop"]  # logged TBT 100 ms against a simulated one of a few ms, one stage
    assert loop["requests"] == 1 and 0.09 < loop["step_s"] < 0.1 and loop["per_model"][0]["model"] == "tiny-2l"
    assert main(["profile", DEMO, "--gateway-log", str(tmp_path / "none.csv"), "-o", str(out)]) == 2
    assert "--gateway-log" in capsys.readouterr().err


def test_a_step_log_gives_the_engine_loop_as_lines_in_the_steps_size(tmp_path, capsys):
    """`--step-log DIR` fits the loop per model and kind from served steps against the cost
    model's stage times (OUTPUT's tables, no loop term)."""
    from paraflex.engine.step_log import STEP_LOG_COLUMNS

    steps = tmp_path / "steps"
    steps.mkdir()
    config = load_config(DEMO)
    placement = tmp_path / "p.json"
    assert main(["plan", DEMO, "-o", str(placement), "-q"]) == 0
    model = config.models[0].name
    mp = Placement.load(placement).models[model]
    a, b = mp.stages[0]
    out = tmp_path / "prof"
    assert main(["profile", DEMO, "-o", str(out), "--models", model, "--tokens", "1,8", "--repeats", "1",
                 "--no-steps", "--no-hop", "-q"]) == 0
    cost, arch = CostModel("cpu", profile_dir=str(out)), config.model(model).arch
    lines = [",".join(STEP_LOG_COLUMNS)]
    for batch in (1, 2, 4):  # the loop adds 1 ms + 0.5 ms per request over the stage's time
        t = cost.decode_time(arch, b - a, batch, 40 * batch, True, mp.num_stages == 1) + 0.001 + 0.0005 * batch
        lines += [f"0,{model},0,{mp.num_stages},decode,{batch},0,{40 * batch},1,0,1.0,{t:.9f},0.001"] * 3
    (steps / "engine-0.csv").write_text("\n".join(lines) + "\n")
    assert main(["profile", DEMO, "--step-log", str(steps), "--placement", str(placement), "-o", str(out)]) == 0
    assert "fitted from 9 logged steps" in capsys.readouterr().out
    loop = json.loads((out / "profile.json").read_text())["engine_loop"]
    entry = loop["per_model"][0]
    assert loop["source"] == "steps" and entry["model"] == model
    assert entry["decode_s"] == pytest.approx(0.001, abs=1e-6) and entry["decode_per_seq_s"] == pytest.approx(0.0005)
    assert loop["step_spread"]["decode"] == pytest.approx([1.0] * SPREAD_POINTS)  # every step on its line
    assert main(["profile", DEMO, "--step-log", str(tmp_path / "none"), "-o", str(out)]) == 2
    assert "--step-log" in capsys.readouterr().err


def test_a_step_log_with_its_request_log_gives_the_return_path_and_the_delays(tmp_path, capsys):
    """`--gateway-log FILE --step-log DIR` of one served run: the way back of each logged token
    (its last step's end -> the frontend) becomes `return_path`, the steps `host_cpu`; the engine path is what the
    logged TTFT has beyond the simulated one, the return path included."""
    from paraflex.engine.step_log import STEP_LOG_COLUMNS
    from paraflex.serving.request_log import LOG_COLUMNS

    model = load_config(DEMO).models[0].name
    placement, out = tmp_path / "p.json", tmp_path / "prof"
    assert main(["plan", DEMO, "-o", str(placement), "-q"]) == 0
    assert main(["profile", DEMO, "-o", str(out), "--models", model, "--tokens", "1,8", "--repeats", "1",
                 "--no-steps", "--no-hop", "-q"]) == 0
    mp = Placement.load(placement).models[model]
    engine, stage = mp.replicas[0][-1], mp.num_stages - 1
    steps, log = [",".join(STEP_LOG_COLUMNS)], [",".join(LOG_COLUMNS)]
    for i in range(3):  # each request alone: prefill, then one decode step; 4 ms back
        t = 100.0 + i
        steps.append(f"{engine},{model},{stage},{mp.num_stages},prefill,1,8,0,1,0,{t:.6f},0.010,0.005,0.009,r{i}")
        steps.append(f"{engine},{model},{stage},{mp.num_stages},decode,1,0,9,1,0,{t + 0.014:.6f},0.005,0.003,0.004,r{i}")
        log.append(f"r{i},{model},0,{t - 0.001:.6f},8,2,{t + 0.014:.6f},{t + 0.023:.6f},0.024,0.015,0.009,0.009,2,"
                   f"{t - 0.002:.6f}")
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / f"engine-{engine}.csv").write_text("\n".join(steps) + "\n")
    (tmp_path / "log.csv").write_text("\n".join(log) + "\n")
    assert main(["profile", DEMO, "--gateway-log", str(tmp_path / "log.csv"), "--step-log", str(tmp_path / "steps"),
                 "--placement", str(placement), "-o", str(out)]) == 0
    assert "return path per token" in capsys.readouterr().out
    meta = json.loads((out / "profile.json").read_text())
    back = meta["return_path"]
    assert back == {"latency_s": pytest.approx(0.004, abs=2e-4), "tokens": 6,  # one engine, one request: no stretch
                    "spread": pytest.approx([1.0] * SPREAD_POINTS)}  # every token 4 ms back: no spread around it
    assert "served_hop" not in meta  # one stage: no hand-over between engines
    host = meta["host_cpu"]  # a cpu cluster: the shared host CPU, fitted from the same steps, on the profiled cores
    assert host["cores"] == meta["host_cores"] and host["steps"] == 6
    assert host["demand_per_engine"] + host["demand_per_request"] <= host["cores"]
    assert meta["gateway"]["delay_s"] == pytest.approx(0.001, abs=1e-5) and meta["gateway"]["engine_path_s"] < 0.015
