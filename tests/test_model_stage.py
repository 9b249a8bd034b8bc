"""Stage model vs transformers: cutting a model into stages computes the same logits."""

import pytest
import torch
from oracle_models import VOCAB, build_llama, build_qwen2

from paraflex.catalog import arch_from_hf_config
from paraflex.engine.attention import AttentionMetadata
from paraflex.engine.model import Stage
from paraflex.engine.model.linear import Linear, onednn_packing_available
from paraflex.engine.model.rope import inv_frequencies
from paraflex.engine.weights import load_stage_weights
from paraflex.errors import UserError


def _stages(directory, cuts):
    arch = arch_from_hf_config(str(directory))
    return arch, [
        Stage(arch, a, b, load_stage_weights(str(directory), arch, a, b, source_kind="hf"))
        for a, b in cuts
    ]


def _run(arch, stages, inputs, query_lens, context_lens, kv, tables, tpb):
    x, offset = inputs, 0
    for st in stages:
        meta = AttentionMetadata.build(query_lens, context_lens, tables[offset:offset + st.num_layers], tpb)
        x = st.forward(x, meta, kv)
        offset += st.num_layers
    return x


@pytest.mark.parametrize("builder,cuts", [
    (build_llama, [(0, 3)]),
    (lambda d: build_llama(d, tie_word_embeddings=True), [(0, 3)]),
    (build_llama, [(0, 1), (1, 3)]),
    (build_qwen2, [(0, 2), (2, 3), (3, 5)]),
])
def test_stages_match_transformers_prefill_then_decode(tmp_path, builder, cuts):
    model = builder(tmp_path)
    arch, stages = _stages(tmp_path, cuts)
    tpb = 4
    kv = torch.zeros(200, 2, tpb, arch.num_kv_heads, arch.head_dim)
    gen = torch.Generator().manual_seed(3)
    lens = [7, 13]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lens]
    # each (layer, request) gets its own scattered blocks: block tables are layer-wise
    perm = torch.randperm(200, generator=gen).tolist()
    tables = [[perm[(l * 2 + i) * 6:(l * 2 + i) * 6 + 6] for i in range(2)] for l in range(arch.num_layers)]
    logits = _run(arch, stages, torch.cat(prompts), lens, lens, kv, tables, tpb)
    with torch.no_grad():
        ref = [model(p[None]).logits[0, -1] for p in prompts]
    assert torch.allclose(logits, torch.stack(ref), atol=1e-4)
    nxt = logits.argmax(-1)
    logits2 = _run(arch, stages, nxt, [1, 1], [n + 1 for n in lens], kv, tables, tpb)
    with torch.no_grad():
        ref2 = [model(torch.cat([p, t[None]])[None]).logits[0, -1] for p, t in zip(prompts, nxt)]
    assert torch.allclose(logits2, torch.stack(ref2), atol=1e-4)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = inv_frequencies(64, 500000.0, None)
    scaled = inv_frequencies(64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})
    assert torch.equal(scaled[:4], plain[:4])  # high frequencies untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8)  # lowest frequency divided by the factor


def test_unknown_rope_scaling_is_a_user_error():
    with pytest.raises(UserError, match="rope_scaling"):
        inv_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_stage_memory_is_its_layers_share(tmp_path):
    build_llama(tmp_path, num_layers=6)
    arch = arch_from_hf_config(str(tmp_path))
    whole = _stages(tmp_path, [(0, 6)])[1][0].weight_bytes()
    _, parts = _stages(tmp_path, [(0, 2), (2, 4), (4, 6)])
    layer = arch.layer_weight_bytes()
    assert sum(p.weight_bytes() for p in parts) == whole
    middle = parts[1].weight_bytes()
    assert middle == 2 * layer  # no embeddings, no head
    assert parts[0].weight_bytes() == 2 * layer + arch.embedding_bytes()
    assert parts[2].weight_bytes() == arch.stage_weight_bytes(4, 6, first=False, last=True)
    assert 0.25 < middle / whole < 0.4  # a third of the layers, less than a third of the model


def test_bfloat16_stages_track_float32(tmp_path):
    model = build_llama(tmp_path, num_layers=3)
    arch = arch_from_hf_config(str(tmp_path))
    ids = torch.tensor([3, 14, 15, 92, 65])
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        st = Stage(arch, 0, 3, load_stage_weights(str(tmp_path), arch, 0, 3, dtype=dtype, source_kind="hf"))
        assert st.dtype == dtype
        kv = torch.zeros(8, 2, 8, arch.num_kv_heads, arch.head_dim, dtype=dtype)
        meta = AttentionMetadata.build([5], [5], [[[0]], [[1]], [[2]]], 8)
        outs[dtype] = st.forward(ids, meta, kv)[0]
    assert outs[torch.bfloat16].dtype == torch.float32  # logits always come back in float32
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    assert torch.allclose(outs[torch.float32], ref, atol=1e-4)
    err = (outs[torch.bfloat16] - ref).abs().max() / ref.abs().max()
    assert err < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 32, 300])
def test_linear_layouts_compute_x_times_w_transposed(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    plain, biased = Linear(w), Linear(w, b)
    packed = onednn_packing_available(x.device, dtype)
    assert (plain.packed is not None) == packed and (plain.weight_t is None) == packed
    assert dtype == torch.float32 or not packed  # only float32 CPU weights are packed
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(plain(x), torch.nn.functional.linear(x, w), **tol)
    torch.testing.assert_close(biased(x), torch.nn.functional.linear(x, w, b), **tol)
    assert biased.nbytes == (96 * 40 + 96) * w.element_size()


def test_tied_table_is_counted_twice_only_beside_a_packed_head(tmp_path):
    build_llama(tmp_path, num_layers=2, tie_word_embeddings=True)
    arch = arch_from_hf_config(str(tmp_path))
    assert arch.tie_embeddings
    f32 = Stage(arch, 0, 2, load_stage_weights(str(tmp_path), arch, 0, 2, source_kind="hf"))
    bf16 = Stage(arch, 0, 2, load_stage_weights(str(tmp_path), arch, 0, 2, torch.bfloat16, source_kind="hf"))
    table = arch.embedding_bytes()
    assert f32.packed == onednn_packing_available(torch.device("cpu"), torch.float32)
    assert f32.weight_bytes() == arch.stage_weight_bytes(0, 2, True, True) + (table if f32.packed else 0)
    assert not bf16.packed and bf16.weight_bytes() * 2 == arch.stage_weight_bytes(0, 2, True, True)
