"""Catalog: built-in numbers against hand computation, byte accounting, HF and GGUF readers."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.catalog import (
    ModelArch,
    arch_from_gguf,
    arch_from_hf_config,
    builtin_names,
    get_arch,
    smollm2_gguf_path,
)
from paraflex.errors import UserError


def test_llama2_7b_parameter_count_by_hand():
    h, f, v, layers = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # q,k,v,o + gate,up,down + two RMSNorms
    expected = v * h + layers * per_layer + h + v * h  # embeddings + blocks + final norm + head
    arch = get_arch("llama-2-7b")
    assert arch.num_params() == expected
    assert abs(arch.num_params() - 6.74e9) / 6.74e9 < 0.001
    assert arch.weight_bytes() == 2 * expected


@pytest.mark.parametrize(
    "name, billions",
    [("llama-2-70b", 68.98), ("codellama-34b-instruct", 33.74), ("internlm2.5-20b-chat", 19.86),
     ("phi-2", 2.78), ("qwen-72b", 72.29), ("llama-3-8b", 8.03), ("llama-3-70b", 70.55),
     ("smollm2-135m", 0.1345)],
)
def test_published_parameter_counts(name, billions):
    assert get_arch(name).num_params() / 1e9 == pytest.approx(billions, rel=0.003)


def test_flops_per_token_by_hand():
    h, f, v = 4096, 11008, 32000
    matmul_weights = 32 * (4 * h * h + 3 * h * f) + v * h  # blocks + LM head (no norms, no gather)
    assert get_arch("llama-2-7b").flops_per_token() == 2 * matmul_weights


def test_kv_bytes_per_token_per_layer_by_hand():
    assert get_arch("llama-2-70b").kv_bytes_per_token_per_layer() == 2 * 8 * 128 * 2
    assert get_arch("llama-2-7b").kv_bytes_per_token_per_layer() == 2 * 32 * 128 * 2
    smol = get_arch("smollm2-135m")
    assert smol.kv_bytes_per_token_per_layer() == 2 * 3 * 64 * 2
    assert smol.kv_bytes_per_token() == 30 * 768


def test_synthetic_depth_scaled_models_share_llama7b_width():
    base = get_arch("llama-2-7b")
    for name, layers in [("llama-20b", 60), ("llama-40b", 120), ("llama-80b", 240)]:
        arch = get_arch(name)
        assert arch.num_layers == layers
        assert arch.layer_weight_bytes() == base.layer_weight_bytes()
        assert arch.weight_bytes() == base.weight_bytes() + (layers - 32) * base.layer_weight_bytes()


def test_builtins_are_consistent():
    names = builtin_names()
    assert {"tiny-2l", "tiny-4l", "tiny-8l", "smollm2-135m", "qwen-72b"} <= set(names)
    for name in names:
        a = get_arch(name)
        assert a.name == name == name.lower()
        assert a.num_heads % a.num_kv_heads == 0
        assert a.head_dim * a.num_heads == a.hidden_size
    tiny = [get_arch(f"tiny-{n}l") for n in (2, 4, 8)]
    assert [t.num_layers for t in tiny] == [2, 4, 8]
    assert all(t.vocab_size == 259 and t.num_kv_heads < t.num_heads for t in tiny)


def test_lookup_is_case_insensitive_and_unknown_names_list_choices():
    assert get_arch("  Llama-2-7B ") is get_arch("llama-2-7b")
    with pytest.raises(UserError, match="llama-2-7b"):
        get_arch("llama-9")


def test_tied_head_needs_its_own_table_on_a_separate_last_stage():
    smol = get_arch("smollm2-135m")
    assert smol.tie_embeddings and smol.head_bytes() == smol.hidden_size * 2
    whole = smol.stage_weight_bytes(0, 30, first=True, last=True)
    assert whole == smol.weight_bytes()
    split = smol.stage_weight_bytes(0, 10, True, False) + smol.stage_weight_bytes(10, 30, False, True)
    assert split == whole + smol.embedding_bytes()


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(["llama-2-70b", "phi-2", "qwen-72b", "tiny-8l", "internlm2.5-20b-chat"]),
       data=st.data())
def test_stage_bytes_add_up_to_the_model_for_any_split(name, data):
    arch = get_arch(name)
    cuts = sorted(data.draw(st.sets(st.integers(1, arch.num_layers - 1), max_size=6)))
    bounds = [0, *cuts, arch.num_layers]
    total = sum(
        arch.stage_weight_bytes(a, b, first=(i == 0), last=(i == len(bounds) - 2))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    )
    assert total == arch.weight_bytes()


def test_stage_range_outside_the_model_is_rejected():
    with pytest.raises(ValueError):
        get_arch("tiny-2l").stage_weight_bytes(1, 3, False, True)


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
