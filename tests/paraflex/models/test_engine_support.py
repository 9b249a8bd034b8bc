"""Checkpoints the engine does not implement are refused before anything is planned or loaded,
with one line naming the config.json field and what is supported, on every entry point that
runs a model; `paraflex simulate` (sizes only) still takes them. Tiny HF configs, and tiny
`transformers` checkpoints where the engine used to load them (silently wrong, or failing on a
missing tensor)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, PhiConfig, PhiForCausalLM

from cli_errors import error_line
from oracle_models import build_llama, build_qwen2, make_config, make_placement
from paraflex.cli import main
from paraflex.config.schema import Config
from paraflex.errors import UserError
from paraflex.models.arch_files import arch_from_hf_config
from paraflex.serving.in_process import LLMCluster

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256}


def _hf_dir(tmp_path, cfg: dict, folder: str = "m"):
    d = tmp_path / folder
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, words", [
    ({"model_type": "gemma"}, "model_type is 'gemma', an architecture the engine does not implement; "
                              "supported: llama, mistral, qwen2"),
    ({"model_type": "gemma2"}, "model_type is 'gemma2'"),
    ({"model_type": "phi"}, "model_type is 'phi'"),
    ({"model_type": "qwen"}, "model_type is 'qwen'"),
    ({"model_type": "mistral", "sliding_window": 128}, "sliding_window is 128, narrower than the context of 256"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window is true"),
    ({"attention_bias": True}, "attention_bias is true (biases on the q/k/v/o projections); the engine "
                               "implements attention_bias false"),
    ({"mlp_bias": True}, "mlp_bias is true"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act is 'gelu_pytorch_tanh'; the engine implements silu"),
])
def test_settings_the_engine_does_not_implement_are_recorded_with_the_field(tmp_path, changes, words):
    arch = arch_from_hf_config(str(_hf_dir(tmp_path, {**LLAMA, **changes})))
    assert words in arch.unsupported
    assert arch.num_layers == 2  # the sizes are still read (the simulator uses them)


@pytest.mark.parametrize("changes", [
    {},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mistral", "sliding_window": 4096},  # wider than the context: never narrows attention
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64},
    {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
])
def test_llama_family_settings_the_engine_implements_are_runnable(tmp_path, changes):
    assert arch_from_hf_config(str(_hf_dir(tmp_path, {**LLAMA, **changes}))).unsupported is None


def _config_file(tmp_path, hf_dir) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1.0},
        "models": [{"name": "g", "hf": str(hf_dir)}],
        "scheduler": {"block_bytes": 4096},
        "workload": {"arrival": "poisson", "num_requests": 5, "seed": 0},
    }))
    return str(path)


@pytest.mark.parametrize("argv", [
    ["plan", "{cfg}", "-o", "{tmp}/p.json"],
    ["serve", "{cfg}", "--in-process", "--port", "0"],
    ["generate", "{cfg}", "--model", "g", "--prompt", "hi"],
    ["profile", "{cfg}", "-o", "{tmp}/prof", "--device", "cpu"],
])
def test_commands_that_run_a_model_refuse_it_in_one_line(tmp_path, capsys, argv):
    cfg = _config_file(tmp_path, _hf_dir(tmp_path, {**LLAMA, "model_type": "gemma"}, "gemma-2b"))
    argv = [a.format(cfg=cfg, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    line = error_line(capsys, argv[0])
    assert line.startswith(f"model 'g': {tmp_path}/gemma-2b/config.json: model_type is 'gemma'"), line
    assert "only `paraflex simulate`" in line


def test_simulate_still_takes_it_and_the_config_round_trips(tmp_path, capsys):
    cfg = _config_file(tmp_path, _hf_dir(tmp_path, {**LLAMA, "model_type": "gemma"}))
    assert main(["simulate", cfg, "--rate", "5", "-o", str(tmp_path / "sim")]) == 0
    config = Config.from_dict(yaml.safe_load(open(cfg)), base_dir=str(tmp_path))
    again = Config.from_dict(config.to_dict())
    assert again.models[0].arch == config.models[0].arch and "gemma" in again.models[0].arch.unsupported


def _saved(model, directory) -> str:
    model.save_pretrained(str(directory))
    return str(directory)


@pytest.mark.parametrize("make, field", [
    (lambda: LlamaForCausalLM(LlamaConfig(**{**LLAMA, "attention_bias": True})), "attention_bias is true"),
    (lambda: LlamaForCausalLM(LlamaConfig(**{**LLAMA, "mlp_bias": True})), "mlp_bias is true"),
    (lambda: PhiForCausalLM(PhiConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=256)), "model_type is 'phi'"),
])
def test_llm_cluster_refuses_checkpoints_it_would_run_wrong(tmp_path, make, field):
    """Before: the Llama checkpoints loaded without their o_proj or MLP biases (wrong tokens) and
    Phi failed on a missing tensor."""
    torch.manual_seed(0)
    directory = _saved(make(), tmp_path / "ckpt")
    config = make_config({"m": directory}, 1)
    with pytest.raises(UserError, match=f"model 'm': .*config.json: {field}"):
        LLMCluster(config, make_placement({"m": (2, [(0, 2)], [[0]])}, 1))


def test_llm_cluster_refuses_only_the_models_it_is_asked_to_load(tmp_path):
    llama, qwen = tmp_path / "llama", tmp_path / "qwen"
    build_llama(llama, num_layers=2)
    build_qwen2(qwen, num_layers=2)
    cfg_path = qwen / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_type": "qwen3"}))
    config = make_config({"llama": llama, "qwen": qwen}, 1)
    placement = make_placement({"llama": (2, [(0, 2)], [[0]]), "qwen": (2, [(0, 2)], [[0]])}, 1)
    assert LLMCluster(config, placement, models=["llama"]).models() == ["llama"]
    with pytest.raises(UserError, match="model 'qwen': .* model_type is 'qwen3'"):
        LLMCluster(config, placement)
