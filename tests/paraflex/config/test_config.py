"""Config loading: shipped configs, every validation error class (with its field path),
YAML/JSON, source resolution and the to_dict round trip."""

import copy
import glob
import json
import os

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.models.arch_files import smollm2_gguf_path
from paraflex.models.catalog import get_arch
from paraflex.config.schema import GIB, Config, load_config
from paraflex.errors import ConfigError, UserError
from repo_paths import REPO

REPO = str(REPO)
SHIPPED = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))

BASE = {
    "cluster": {"num_engines": 4, "device": "a100-80g", "tp": 2, "memory_gb": 100},
    "models": [
        {"name": "a", "arch": "llama-2-7b", "rate": 2},
        {"name": "b", "arch": "llama-3-8b", "rate": 1, "slo_ttft_ms": 500},
        {"name": "c", "arch": "phi-2", "rate": 3},
    ],
}


def make(**changes):
    """BASE with dotted-path changes, e.g. make(**{"models[2].rate": 0})."""
    d = copy.deepcopy(BASE)
    for path, value in changes.items():
        node, parts = d, path.replace("]", "").replace("[", ".").split(".")
        for p in parts[:-1]:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        if value is _DELETE:
            del node[parts[-1]]
        else:
            node[int(parts[-1]) if parts[-1].isdigit() else parts[-1]] = value
    return d


_DELETE = object()


def test_shipped_configs_exist_and_load():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"demo.yaml", "paper-base.yaml", "paper-testbed.yaml", "dispersion-2x.yaml",
            "dispersion-4x.yaml"} <= names
    for path in SHIPPED:
        cfg = load_config(path)
        assert cfg.models and cfg.cluster.num_engines >= 1
        assert Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_paper_base_matches_section_8_1():
    cfg = load_config(os.path.join(REPO, "configs", "paper-base.yaml"))
    c = cfg.cluster
    assert (c.num_engines, c.device, c.tp, c.interconnect_gbps) == (8, "a100-80g", 8, 200)
    assert [m.arch.name for m in cfg.models] == ["internlm2.5-20b-chat", "internlm2.5-20b-chat",
                                                "codellama-34b-instruct", "llama-2-70b"]
    assert len({m.name for m in cfg.models}) == 4
    rates = [m.rate for m in cfg.models]
    assert rates == sorted(rates, reverse=True)
    assert rates[0] == pytest.approx(0.49, abs=0.01)  # "the top model accounts for 49%"


def test_dispersion_configs_follow_section_8_4():
    two = load_config(os.path.join(REPO, "configs", "dispersion-2x.yaml"))
    four = load_config(os.path.join(REPO, "configs", "dispersion-4x.yaml"))
    assert sorted(m.arch.name for m in two.models) == ["llama-40b", "llama-40b", "llama-80b"]
    assert sorted(m.arch.name for m in four.models) == ["llama-20b"] * 4 + ["llama-80b"]
    assert len({m.rate for m in four.models}) == 1


def test_demo_resolves_smollm2_to_the_package_gguf():
    cfg = load_config(os.path.join(REPO, "configs", "demo.yaml"))
    smol = cfg.model("smollm2-135m")
    assert smol.source == smollm2_gguf_path() and smol.source_kind == "gguf"
    assert smol.arch.dtype_bytes == 4  # dtype: float32 override
    assert cfg.cluster.device == "cpu" and cfg.cluster.num_engines == 4


def test_defaults_and_units():
    cfg = Config.from_dict(make(**{"cluster.memory_gb": _DELETE}))
    assert cfg.cluster.memory_gb == pytest.approx(0.9 * 80 * 2)
    assert cfg.cluster.memory_bytes == int(144 * GIB)
    assert cfg.planner.target_stage_time == "auto" and cfg.planner.ring is False
    assert cfg.scheduler.max_batch_size == 32 and cfg.scheduler.block_bytes == 32768
    assert cfg.scheduler.dispatch == "least-load" and cfg.scheduler.home_margin == 4
    assert cfg.workload is None
    assert cfg.model("b").slo_ttft_ms == 500 and cfg.model("a").slo_tbt_ms is None
    link = cfg.cluster.interconnect()
    assert link.transfer_time(0) == 0 and link.transfer_time(10**9) > 10**9 / (100e9 / 8)


@pytest.mark.parametrize(
    "changes, path, fix",
    [
        ({"cluster.gpus": 3}, "cluster.gpus", "allowed keys"),
        ({"models[1].ratee": 3}, "models[1].ratee", "allowed keys"),
        ({"planner.kapa_gb": 3}, "planner.kapa_gb", "allowed keys"),
        ({"extra": 1}, "extra", "allowed keys"),
        ({"models[2].rate": 0}, "models[2].rate", "> 0"),
        ({"models[2].rate": -1.5}, "models[2].rate", "> 0"),
        ({"models[0].rate": "fast"}, "models[0].rate", "number"),
        ({"cluster.num_engines": 2.5}, "cluster.num_engines", "integer"),
        ({"cluster.num_engines": 0}, "cluster.num_engines", ">= 1"),
        ({"cluster.num_engines": _DELETE}, "cluster.num_engines", "missing"),
        ({"cluster.memory_gb": -4}, "cluster.memory_gb", "> 0"),
        ({"cluster.memory_gb": 500}, "cluster.memory_gb", "lower it"),
        ({"cluster.host_memory_gb": -1}, "cluster.host_memory_gb", ">= 0"),
        ({"cluster.device": "tpu-v9"}, "cluster.device", "a100-80g"),
        ({"cluster.tp": 3}, "models[0].arch", "divide"),
        ({"models[1].arch": "llama-9"}, "models[1].arch", "unknown built-in"),
        ({"models[1].hf": "x"}, "models[1]", "exactly one"),
        ({"models[1].arch": _DELETE}, "models[1]", "exactly one"),
        ({"models[1].name": "a"}, "models[1].name", "duplicate"),
        ({"models[0].stages": 0}, "models[0].stages", ">= 1"),
        ({"models[2].stages": 33}, "models[2].stages", "at most 32"),
        ({"models[1].stages": 5}, "models[1].stages", "4 engines"),
        ({"models[1].stages": 1.5}, "models[1].stages", "integer"),
        ({"models[1].name": "bad name!"}, "models[1].name", "letters"),
        ({"models[0].arch": "llama-2-70b", "cluster.num_engines": 1}, "models[0].arch", "whole cluster"),
        ({"planner.target_stage_time": "fast"}, "planner.target_stage_time", "x2"),
        ({"planner.target_stage_time": "x0"}, "planner.target_stage_time", "> 0"),
        ({"planner.target_stage_time": -5}, "planner.target_stage_time", "> 0"),
        ({"planner.target_stage_time": "0ms"}, "planner.target_stage_time", "> 0"),
        ({"planner.target_stage_time": True}, "planner.target_stage_time", "auto"),
        ({"planner.ring": "yes"}, "planner.ring", "true or false"),
        ({"planner.kappa_gb": -1}, "planner.kappa_gb", ">= 0"),
        ({"planner.replica_shares": "rates"}, "planner.replica_shares", "work, stages"),
        ({"scheduler.block_bytes": 30000}, "scheduler.block_bytes", "power of two"),
        ({"scheduler.policy": "fifo"}, "scheduler.policy", "full-batch-first"),
        ({"scheduler.max_batch_size": 0}, "scheduler.max_batch_size", ">= 1"),
        ({"scheduler.dispatch": "random"}, "scheduler.dispatch", "least-outstanding"),
        ({"scheduler.home_margin": -1}, "scheduler.home_margin", ">= 0"),
        ({"scheduler.head_start_s": [5]}, "scheduler.head_start_s", "mapping of model name"),
        ({"scheduler.head_start_s": {"a": -1}}, "scheduler.head_start_s.a", ">= 0"),
        ({"scheduler.head_start_s": {"a": "5s"}}, "scheduler.head_start_s.a", "seconds"),
        ({"scheduler.head_start_s": {"zz": 5}}, "scheduler.head_start_s.zz", "no model named 'zz'"),
        ({"workload.arrival": "burst"}, "workload.arrival", "poisson"),
        ({"workload.arrival": "trace"}, "workload.trace", "CSV"),
        ({"workload.trace": "nope.csv"}, "workload.trace", "does not exist"),
        ({"workload.cv": 0}, "workload.cv", "> 0"),
        ({"workload.zipf_alpha": 1.0}, "models[0].rate", "zipf_alpha"),
        ({"models": []}, "models", "non-empty"),
        ({"cluster": [1, 2]}, "cluster", "mapping"),
    ],
)
def test_validation_errors_name_the_field(changes, path, fix):
    with pytest.raises(ConfigError) as info:
        Config.from_dict(make(**changes))
    assert info.value.path == path
    assert str(info.value).startswith(path + ":")
    assert fix in str(info.value)


def test_json_and_yaml_by_extension_and_relative_paths(tmp_path):
    hf = tmp_path / "models" / "mini"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}))
    (tmp_path / "trace.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,3\n")
    d = {"cluster": {"num_engines": 2, "memory_gb": 1},
         "models": [{"name": "mini", "hf": "models/mini"}],
         "workload": {"arrival": "trace", "trace": "trace.csv"}}
    (tmp_path / "c.json").write_text(json.dumps(d))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(d))
    for name in ("c.json", "c.yml"):
        cfg = load_config(str(tmp_path / name))
        assert cfg.models[0].source == str(hf) and cfg.models[0].source_kind == "hf"
        assert cfg.models[0].arch.num_layers == 2
        assert cfg.workload.trace == str(tmp_path / "trace.csv")
        again = Config.from_dict(cfg.to_dict())
        assert again.models[0].arch == cfg.models[0].arch and again.models[0].source == str(hf)
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(UserError, match="extension"):
        load_config(str(tmp_path / "c.toml"))
    (tmp_path / "bad.yaml").write_text("cluster: [\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_missing_hf_dir_is_reported_at_the_model(tmp_path):
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"cluster": {"num_engines": 1}, "models": [{"hf": "nowhere"}]}, base_dir=str(tmp_path))
    assert info.value.path == "models[0].hf"


def test_target_stage_time_forms():
    for value, auto, expected in [("auto", 0.04, 0.04), (25, 1.0, 0.025), ("x2", 0.04, 0.08),
                                  ("/2", 0.04, 0.02), ("X1.5", 0.02, 0.03), ("40ms", 1.0, 0.04),
                                  ("12.5 ms", 1.0, 0.0125)]:
        cfg = Config.from_dict(make(**{"planner.target_stage_time": value}))
        assert cfg.planner.resolve_target_stage_time(auto) == pytest.approx(expected)


def test_zipf_rates_follow_list_order():
    d = make(**{f"models[{i}].rate": _DELETE for i in range(3)})
    d["workload"] = {"zipf_alpha": 1.01, "rate": 10}
    cfg = Config.from_dict(d)
    weights = [1 / k**1.01 for k in (1, 2, 3)]
    assert [m.rate for m in cfg.models] == pytest.approx([w / sum(weights) for w in weights])
    assert Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_model_name_defaults_to_arch_and_dtype_override():
    d = make()
    d["models"] = [{"arch": "tiny-2l", "dtype": "bfloat16"}]
    cfg = Config.from_dict(d)
    assert cfg.models[0].name == "tiny-2l"
    assert cfg.models[0].arch.dtype_bytes == 2 and get_arch("tiny-2l").dtype_bytes == 4
    with pytest.raises(UserError, match="no model named"):
        cfg.model("other")


def test_pure_modules_import_no_torch_ray_or_http():
    import subprocess
    import sys

    code = ("import sys, paraflex.config.schema, paraflex.models.catalog, paraflex.costs.costmodel, paraflex.costs.profile_tables;"
            "from paraflex.config.schema import load_config; load_config(sys.argv[1]).cluster.cost_model();"
            "bad = [m for m in ('torch', 'ray', 'fastapi', 'httpx', 'uvicorn', 'gguf') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "configs", "paper-base.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


_names = st.sampled_from(["tiny-2l", "tiny-4l", "tiny-8l", "smollm2-135m", "llama-2-7b", "phi-2"])


@settings(max_examples=40, deadline=None)
@given(
    engines=st.integers(1, 64),
    tp=st.sampled_from([1]),
    mem=st.floats(20, 70),
    models=st.lists(st.tuples(_names, st.floats(0.01, 100)), min_size=1, max_size=5),
    ts=st.one_of(st.just("auto"), st.floats(0.5, 500), st.sampled_from(["x2", "/3", "x0.5"])),
    ring=st.booleans(),
    budget=st.one_of(st.none(), st.integers(1, 8192)),
    workload=st.one_of(st.none(), st.fixed_dictionaries({
        "arrival": st.sampled_from(["poisson", "lognormal"]), "cv": st.floats(0.1, 30),
        "rate": st.floats(0.1, 100), "seed": st.integers(0, 10**6)})),
)
def test_random_valid_configs_round_trip(engines, tp, mem, models, ts, ring, budget, workload):
    d = {"cluster": {"num_engines": engines, "device": "h200", "tp": tp, "memory_gb": mem},
         "models": [{"name": f"m{i}", "arch": a, "rate": r} for i, (a, r) in enumerate(models)],
         "planner": {"target_stage_time": ts, "ring": ring},
         "scheduler": {"prefill_token_budget": budget}}
    if workload is not None:
        d["workload"] = workload
    cfg = Config.from_dict(d)
    assert [m.rate for m in cfg.models] == [r for _a, r in models]
    again = Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert again.models == cfg.models and again.cluster == cfg.cluster and again.planner == cfg.planner
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()  # JSON-serialisable


def test_profile_dir_reaches_the_cost_model(tmp_path):
    from paraflex.costs.profile_tables import ALL_OPS

    table = tmp_path / "profiles" / "cpu" / "demo" / "tiny"
    table.mkdir(parents=True)
    cols = [f"time_stats.{op}.median" for op in ALL_OPS]
    shape = "4,2,64,192,259,True"  # tiny-2l: heads, kv heads, hidden, ffn, vocab, gated
    rows = [",".join([str(n * 1e-3)] * len(cols)) + f",{shape},{n},1" for n in (1, 100)]
    (table / "mlp.csv").write_text(
        ",".join(cols) + ",n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,use_gated_mlp,"
        "num_tokens,num_tensor_parallel_workers\n" + "\n".join(rows) + "\n")
    (tmp_path / "c.yaml").write_text(
        "cluster: {num_engines: 1, memory_gb: 1, profile_dir: profiles}\nmodels: [{arch: tiny-2l}]\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.cluster.profile_dir == str(tmp_path / "profiles")
    cm = cfg.cluster.cost_model()
    assert cm.linear_time(cfg.models[0].arch, 10) == pytest.approx(10 * 10e-6)


def test_missing_profile_dir_says_where_it_was_looked_up(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "profiles").mkdir()  # beside the config's folder, as `paraflex profile -o profiles` leaves it
    (tmp_path / "configs" / "c.yaml").write_text(
        "cluster: {num_engines: 1, memory_gb: 1, profile_dir: profiles}\nmodels: [{arch: tiny-2l}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "configs" / "c.yaml"))
    assert str(tmp_path / "configs" / "profiles") in str(err.value)
    assert "taken from the config's folder" in str(err.value)


def test_stages_round_trip_and_default_to_the_planners_cut():
    cfg = Config.from_dict(make(**{"models[0].stages": 3}))
    assert [m.stages for m in cfg.models] == [3, None, None]
    assert cfg.to_dict()["models"][0]["stages"] == 3 and "stages" not in cfg.to_dict()["models"][1]
    assert Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
