"""Catalog: built-in numbers against hand computation and byte accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.models.catalog import builtin_names, get_arch
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
