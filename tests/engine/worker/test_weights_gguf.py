"""GGUF loading: dequantization, llama's Q/K un-permutation, stage-only reads, SmolLM2 end to end."""

import numpy as np
import pytest
import torch
from oracle_models import build_llama, make_placement

from paraflex.models.arch_files import arch_from_gguf
from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.model import Stage
from paraflex.engine.worker.weights import load_stage_weights
from paraflex.engine.worker.weights.gguf_loader import hf_name, unpermute_rotary

_TO_GGUF = {v: k for k, v in {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight"}.items()}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, qtype):
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{_TO_GGUF[rest]}"
            if rest == "self_attn.q_proj.weight":
                a = _permute(a, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                a = _permute(a, cfg.num_key_value_heads)
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_the_converter_permutation():
    w = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8 * 3, 4)
    assert np.array_equal(unpermute_rotary(_permute(w, 3), 3), w)


def test_gguf_names_map_to_hf():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize("qname,tol", [("F32", 1e-4), ("F16", 2e-2), ("Q8_0", 0.15)])
def test_gguf_stages_match_transformers(tmp_path, qname, tol):
    import gguf

    model = build_llama(tmp_path / "hf", num_layers=3, llama3_rope=False)
    path = tmp_path / f"m-{qname}.gguf"
    write_gguf(model, path, gguf.GGMLQuantizationType[qname])
    arch = arch_from_gguf(str(path))
    assert arch.num_layers == 3 and not arch.tie_embeddings
    stages = [Stage(arch, a, b, load_stage_weights(str(path), arch, a, b)) for a, b in [(0, 2), (2, 3)]]
    ids = torch.tensor([5, 17, 99, 3, 250, 8])
    kv = torch.zeros(16, 2, 8, arch.num_kv_heads, arch.head_dim)
    x = ids
    for st, layers in zip(stages, [[0, 1], [2]]):
        meta = AttentionMetadata.build([6], [6], [[[layer]] for layer in layers], 8)
        x = st.forward(x, meta, kv)
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    assert (x[0] - ref).abs().max().item() < tol * ref.abs().max().item()


def test_stage_reads_only_its_layers(tmp_path):
    model = build_llama(tmp_path / "hf", num_layers=3, llama3_rope=False)
    import gguf

    path = tmp_path / "m.gguf"
    write_gguf(model, path, gguf.GGMLQuantizationType.F32)
    arch = arch_from_gguf(str(path))
    w = load_stage_weights(str(path), arch, 1, 2)
    assert {k.split(".")[2] for k in w} == {"1"}  # layer 1 only: no embeddings, no head


def _smollm2_cluster(num_stages):
    from paraflex.config.schema import Config
    from paraflex.serving.in_process import LLMCluster

    cuts = [(i * 30 // num_stages, (i + 1) * 30 // num_stages) for i in range(num_stages)]
    cfg = Config.from_dict({"cluster": {"num_engines": num_stages, "device": "cpu", "memory_gb": 2},
                            "models": [{"name": "smollm2", "gguf": "smollm2-135m"}]})
    pl = make_placement({"smollm2": (30, cuts, [list(range(num_stages))])}, num_stages, kv_bytes=16 << 20)
    return LLMCluster(cfg, pl)


@pytest.mark.slow
def test_smollm2_answers_paris_through_three_stages():
    from paraflex.engine.core.sampling_params import SamplingParams

    cluster = _smollm2_cluster(3)
    tok = cluster.tokenizer("smollm2")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = cluster.generate("smollm2", prompt, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and result.token_ids[-1] in tok.eos_token_ids
