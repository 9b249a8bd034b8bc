"""Stage model vs transformers: cutting a model into stages computes the same logits."""

import contextlib
import os
from unittest import mock

import pytest
import torch
from oracle_models import VOCAB, build_llama, build_qwen2, run_stages

from paraflex.models.arch_files import arch_from_hf_config
from paraflex.engine.kernels import native_build
from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.model import Stage
from paraflex.engine.worker.model import linear as linear_module
from paraflex.engine.worker.model.linear import Linear
from paraflex.engine.worker.model.rope import inv_frequencies
from paraflex.engine.worker.weights import load_stage_weights
from paraflex.errors import UserError


def _stages(directory, cuts):
    arch = arch_from_hf_config(str(directory))
    return arch, [
        Stage(arch, a, b, load_stage_weights(str(directory), arch, a, b, source_kind="hf"))
        for a, b in cuts
    ]


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
    logits = run_stages(stages, torch.cat(prompts), lens, lens, kv, tables, tpb)
    with torch.no_grad():
        ref = [model(p[None]).logits[0, -1] for p in prompts]
    assert torch.allclose(logits, torch.stack(ref), atol=1e-4)
    nxt = logits.argmax(-1)
    logits2 = run_stages(stages, nxt, [1, 1], [n + 1 for n in lens], kv, tables, tpb)
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


def _layout(name):
    """Build Linears in one layout: compiled panels (as on this machine), oneDNN, or plain mm
    (the first candidate left, the chooser off)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.dict(os.environ, {"PARAFLEX_LINEAR_CHOOSER": "0"}))
    if name != "panels":
        stack.enter_context(mock.patch.object(linear_module, "native_available", lambda *_: False))
    if name == "plain":
        stack.enter_context(mock.patch.object(linear_module, "onednn_packing_available", lambda *_: False))
    return stack


def _needs_layout(layout):
    if layout == "panels":
        if native_build.compiler() is None:
            pytest.skip("no C compiler on this machine")
        assert linear_module.LIBRARY.load() is not None  # a failed build only warns: fail here
    if layout == "onednn" and not linear_module.onednn_packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")


@pytest.mark.parametrize("layout", ["panels", "onednn", "plain"])
@pytest.mark.parametrize("out_features,in_features", [(96, 40), (100, 7), (5, 33), (96, 600), (100, 577)])
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 300])
def test_float32_layouts_compute_x_times_w_transposed(layout, out_features, in_features, rows):
    """Every CPU layout, including panels cut mid-way (columns not a multiple of 16), row
    counts that leave partial 6-row tiles and 96-row blocks, and long inputs (hundreds of
    products per sum)."""
    _needs_layout(layout)
    g = torch.Generator().manual_seed(rows + out_features)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    with _layout(layout):
        plain, biased = Linear(w), Linear(w, b)
    assert (plain.panels is not None, plain.packed is not None, plain.weight_t is not None) == (
        layout == "panels", layout == "onednn", layout == "plain")
    atol = 1e-5 * max(1.0, in_features / 64)  # float32 rounding of sums of in_features products
    torch.testing.assert_close(plain(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=atol)
    torch.testing.assert_close(biased(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=atol)
    if plain.holds_rows:
        ids = torch.tensor([0, out_features - 1, out_features // 2, 0])
        assert torch.equal(plain.rows(ids), w[ids])


def test_compiled_projections_give_the_same_sums_on_any_number_of_threads():
    _needs_layout("panels")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 64, generator=g), torch.randn(200, 64, generator=g)
    lin = Linear(w, layout="panels")
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("layout", ["onednn", "mm"])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_bfloat16_layouts_compute_x_times_w_transposed(layout, rows):
    if layout == "onednn" and not linear_module.onednn_packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU has no native bfloat16 (avx512_bf16 / AMX): bfloat16 weights stay in torch.mm's layout")
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    plain, biased = Linear(w, layout=layout), Linear(w, b, layout=layout)
    assert (plain.weight_t is not None, plain.packed is not None, plain.panels) == (layout == "mm", layout == "onednn", None)
    assert "panels" not in linear_module.candidate_layouts(torch.device("cpu"), torch.bfloat16)
    tol = {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(plain(x), torch.nn.functional.linear(x, w), **tol)
    torch.testing.assert_close(biased(x), torch.nn.functional.linear(x, w, b), **tol)
    if layout == "mm":
        assert biased.nbytes == (96 * 40 + 96) * w.element_size()


@pytest.mark.parametrize("vocab", [VOCAB, VOCAB + 10])  # the second leaves a partial last panel
@pytest.mark.parametrize("layout", ["panels", "onednn", "plain"])
def test_tied_table_is_held_twice_only_beside_a_onednn_head(tmp_path, layout, vocab):
    _needs_layout(layout)
    build_llama(tmp_path, num_layers=2, tie_word_embeddings=True, vocab_size=vocab)
    arch = arch_from_hf_config(str(tmp_path))
    assert arch.tie_embeddings
    with _layout(layout):
        f32 = Stage(arch, 0, 2, load_stage_weights(str(tmp_path), arch, 0, 2, source_kind="hf"))
    with _layout("plain"):
        bf16 = Stage(arch, 0, 2, load_stage_weights(str(tmp_path), arch, 0, 2, torch.bfloat16, source_kind="hf"))
    table = arch.embedding_bytes()
    padding = (-arch.vocab_size % linear_module.PANEL) * arch.hidden_size * 4 if layout == "panels" else 0
    assert f32.head_is_embed == (layout != "onednn")
    assert f32.packed == (layout != "plain")
    assert f32.weight_bytes() == arch.stage_weight_bytes(0, 2, True, True) + padding + (
        table if layout == "onednn" else 0)
    assert not bf16.packed and bf16.weight_bytes() * 2 == arch.stage_weight_bytes(0, 2, True, True)
    ids = torch.tensor([3, 1, 4, 1, 5])
    meta = AttentionMetadata.build([5], [5], [[[0, 1]]] * 2, 4)
    kv = torch.zeros(4, 2, 4, arch.num_kv_heads, arch.head_dim)
    with _layout("plain"):
        reference = Stage(arch, 0, 2, load_stage_weights(str(tmp_path), arch, 0, 2, source_kind="hf"))
    torch.testing.assert_close(f32.forward(ids, meta, kv), reference.forward(ids, meta, kv.clone()),
                               rtol=1e-4, atol=1e-4)


def test_the_kernels_thread_pool_runs_thousands_of_small_jobs_exactly():
    """Back-to-back jobs of 1-40 items on 1-4 threads (workers spinning, sleeping, waking late)
    each give the one-thread result into an output filled with NaN first: an item lost leaves
    NaN, an item of a stale job run on these outputs would write the wrong panel's values."""
    _needs_layout("panels")
    g = torch.Generator().manual_seed(1)
    lins = [Linear(torch.randn(16 * n, 24, generator=g), layout="panels") for n in (1, 3, 40)]
    xs = [torch.randn(rows, 24, generator=g) for rows in (1, 5, 100)]

    def run(lin, x, threads):
        out = torch.full((x.shape[0], lin.out_features), float("nan"))
        linear_module.LIBRARY.lib.pf_linear(x.data_ptr(), x.shape[0], lin.in_features, lin.panels.data_ptr(),
                                            None, lin.out_features, out.data_ptr(), threads)
        return out

    want = [[run(lin, x, 1) for x in xs] for lin in lins]
    for round_ in range(300):
        for i, lin in enumerate(lins):
            for j, x in enumerate(xs):
                assert torch.equal(run(lin, x, 1 + (round_ + i + j) % 4), want[i][j])


def test_two_threads_calling_the_kernels_at_once_both_get_exact_results():
    """Two engines' threads in one process: the second caller runs on its own thread while the
    pool is busy; neither sees the other's items."""
    import threading

    _needs_layout("panels")
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(16 * 40, 64, generator=g), layout="panels")
    xs = [torch.randn(50, 64, generator=g) for _ in range(2)]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    want = [lin(x) for x in xs]
    torch.set_num_threads(2)
    bad = []

    def hammer(i):
        for _ in range(300):
            if not torch.equal(lin(xs[i]), want[i]):
                bad.append(i)

    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(previous)
    assert bad == []
