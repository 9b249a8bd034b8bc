"""Architectures read from files: HF config.json and GGUF headers against the built-ins and
hand-written values, and the one-line errors for files that cannot make a model."""

import json

import numpy as np
import pytest

from paraflex.models.arch_files import arch_from_gguf, arch_from_hf_config, smollm2_gguf_path
from paraflex.models.catalog import ModelArch, get_arch
from paraflex.errors import UserError


def _write(tmp_path, cfg, folder="my-model"):
    d = tmp_path / folder
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hf_llama_config_matches_builtin(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
           "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "torch_dtype": "float16", "tie_word_embeddings": False}
    arch = arch_from_hf_config(str(_write(tmp_path, cfg, "Llama-2-7b-hf")))
    assert arch.name == "llama-2-7b-hf"
    assert arch == ModelArch(**{**get_arch("llama-2-7b").to_dict(), "name": arch.name})


def test_hf_qwen_v1_and_transformers5_rope(tmp_path):
    qwen = {"model_type": "qwen", "num_hidden_layers": 80, "hidden_size": 8192,
            "intermediate_size": 49152, "num_attention_heads": 64, "vocab_size": 152064,
            "seq_length": 32768, "rotary_emb_base": 1000000, "layer_norm_epsilon": 1e-6}
    arch = arch_from_hf_config(str(_write(tmp_path, qwen, "q") / "config.json"))
    assert arch.intermediate_size == 24576 and arch.qkv_bias and arch.num_kv_heads == 64
    assert arch.num_params() == get_arch("qwen-72b").num_params()
    l3 = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    arch = arch_from_hf_config(str(_write(tmp_path, l3, "l3")))
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "llama3"


def test_hf_errors_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        arch_from_hf_config(str(tmp_path))
    bad = _write(tmp_path, {"hidden_size": 8}, "bad")
    with pytest.raises(UserError, match="num_attention_heads"):
        arch_from_hf_config(str(bad))


def _tiny_gguf(path, with_output: bool, heads=6, layers=True):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Tiny Test")
    if layers:
        w.add_block_count(3)
    w.add_embedding_length(48)
    w.add_feed_forward_length(96)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    w.add_context_length(1024)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(77)])
    w.add_tensor("token_embd.weight", np.zeros((77, 48), dtype=np.float32))
    if with_output:
        w.add_tensor("output.weight", np.zeros((77, 48), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("with_output", [True, False])
def test_gguf_header(tmp_path, with_output):
    arch = arch_from_gguf(_tiny_gguf(tmp_path / "t.gguf", with_output))
    assert (arch.name, arch.num_layers, arch.hidden_size, arch.intermediate_size) == ("tiny-test", 3, 48, 96)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (6, 2, 8, 77)
    assert (arch.max_context, arch.rope_theta, arch.rms_norm_eps) == (1024, 50000.0, 1e-6)
    assert arch.tie_embeddings is (not with_output)


def test_gguf_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        arch_from_gguf(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="cannot read GGUF"):
        arch_from_gguf(str(junk))


@pytest.mark.parametrize("heads, layers, message", [
    (0, True, "'llama.attention.head_count' is 0, not a positive number"),
    ([6, 6, 6], True, r"'llama.attention.head_count' is \[6, 6, 6\], not a positive number; .*no per-layer arrays"),
    (6, False, "lacks llama.block_count; is it a decoder-only LLM"),
])
def test_gguf_header_values_that_cannot_make_a_model(tmp_path, heads, layers, message):
    path = _tiny_gguf(tmp_path / f"bad-{layers}.gguf", False, heads=heads, layers=layers)
    with pytest.raises(UserError, match=message):
        arch_from_gguf(path)


@pytest.mark.slow
def test_smollm2_package_gguf_header_equals_builtin():
    """The config loader uses the built-in numbers for `gguf: smollm2-135m`; check they match."""
    arch = arch_from_gguf(smollm2_gguf_path(), name="smollm2-135m")
    assert arch == get_arch("smollm2-135m")
