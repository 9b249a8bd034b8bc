"""Config validation: non-UTF-8 files, the device field, broken HF config.json files and the
types of an inline `arch:` mapping each give a one-line error naming the field (exit 2)."""

from __future__ import annotations

import json

import pytest

from paraflex.cli import main
from paraflex.config.schema import Config, load_config
from paraflex.errors import ConfigError, UserError

ARCH = {"name": "t", "num_layers": 2, "hidden_size": 64, "intermediate_size": 192, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "vocab_size": 259}
HF = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}


def _config(model: dict, **cluster) -> dict:
    return {"cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1, **cluster}, "models": [model]}


def _plan_error(tmp_path, capsys, data: dict) -> tuple[int, str]:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(data))
    code = main(["plan", str(cfg), "-o", str(tmp_path / "p.json")])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("ext", [".yaml", ".json"])
def test_non_utf8_config_is_a_user_error(tmp_path, capsys, ext):
    cfg = tmp_path / f"c{ext}"
    cfg.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(UserError, match=r"c\.(yaml|json) is not UTF-8 text; give a YAML or JSON config file"):
        load_config(str(cfg))
    assert main(["plan", str(cfg)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_device_as_a_number_names_the_field_once(tmp_path, capsys):
    code, err = _plan_error(tmp_path, capsys, _config({"arch": "tiny-2l"}, device=5))
    assert code == 2 and err.count("cluster.device") == 1 and "cluster.device: expected a string, got int 5" in err


@pytest.mark.parametrize("content, fix", [
    ("[1, 2]", "holds a JSON list, not an object of model settings"),
    (json.dumps({**HF, "num_hidden_layers": "x"}), "'num_hidden_layers' is 'x', not a positive number"),
    (json.dumps({**HF, "num_attention_heads": 0}), "'num_attention_heads' is 0, not a positive number"),
    (json.dumps({**HF, "rope_theta": "fast"}), "'rope_theta' is 'fast', not a positive number"),
], ids=["list", "layers", "heads", "rope_theta"])
def test_broken_hf_config_json_names_the_file_and_key(tmp_path, capsys, content, fix):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(content)
    with pytest.raises(ConfigError) as info:
        Config.from_dict(_config({"hf": "m"}), base_dir=str(tmp_path))
    assert info.value.path == "models[0].hf"
    assert str(tmp_path / "m" / "config.json") in str(info.value) and fix in str(info.value)
    code, err = _plan_error(tmp_path, capsys, _config({"hf": str(tmp_path / "m")}))
    assert code == 2 and fix in err and len(err.splitlines()) == 1


def test_non_utf8_hf_config_json_is_a_config_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read HF config .*config.json"):
        Config.from_dict(_config({"hf": "m"}), base_dir=str(tmp_path))


@pytest.mark.parametrize("key, value, fix", [
    ("name", [1], "expected a string, got a list"),
    ("rope_theta", "fast", "expected a number, got the string 'fast'"),
    ("rms_norm_eps", -1, "must be > 0"),
    ("gated_mlp", "maybe", "expected true or false, got the string 'maybe'"),
    ("dtype_bytes", 3, "must be 1, 2 or 4 bytes per parameter"),
    ("num_layers", True, "expected an integer, got True"),
    ("rope_scaling", 5, "expected a mapping"),
    ("vocab_size", None, "missing required key"),
    ("bogus", 1, "unknown key"),
])
def test_inline_arch_fields_are_type_checked(tmp_path, capsys, key, value, fix):
    arch = {k: v for k, v in {**ARCH, key: value}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        Config.from_dict(_config({"name": "a", "arch": arch}))
    assert info.value.path == f"models[0].arch.{key}" and fix in info.value.reason
    code, err = _plan_error(tmp_path, capsys, _config({"name": "a", "arch": arch}))
    assert code == 2 and f"models[0].arch.{key}: {fix}" in err and len(err.splitlines()) == 1


def test_inline_arch_mapping_keeps_its_values():
    arch = {**ARCH, "dtype_bytes": 4, "rope_theta": 1e6, "gated_mlp": False, "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = Config.from_dict(_config({"name": "a", "arch": arch}))
    a = cfg.models[0].arch
    assert (a.dtype_bytes, a.rope_theta, a.gated_mlp, a.rope_scaling) == (4, 1e6, False, {"type": "linear", "factor": 2.0})
    assert Config.from_dict(cfg.to_dict()).models[0].arch == a


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "cluster: {num_engines: 1, device: cpu, memory_gb: 1}\nmodels: [{name: a, arch: tiny-2l}]\n"
               "cluster: {num_engines: 2}\n", "key 'cluster' appears twice in one mapping"),
    ("c.yaml", "cluster: {num_engines: 1, device: cpu, memory_gb: 1, num_engines: 2}\nmodels: [{name: a, arch: tiny-2l}]\n",
     "key 'num_engines' appears twice in one mapping"),
    ("c.json", '{"cluster": {"num_engines": 1, "num_engines": 2}, "models": [{"name": "a", "arch": "tiny-2l"}]}',
     "key 'num_engines' appears twice in one object"),
])
def test_a_key_given_twice_is_an_error(tmp_path, name, text, message):
    """(yaml and json keep the last of two equal keys: a silent override of the first)"""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_config(str(path))


def test_plan_time_limit_must_be_finite(tmp_path, capsys):
    code, err = _plan_error(tmp_path, capsys, _config({"name": "a", "arch": "tiny-2l"}))
    assert code == 0
    cfg = tmp_path / "c.json"
    assert main(["plan", str(cfg), "--time-limit", "nan", "-o", str(tmp_path / "p.json")]) == 2
    assert "--time-limit must be a finite number > 0" in capsys.readouterr().err
