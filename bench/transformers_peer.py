"""Hugging Face `transformers` as a same-run peer of `paraflex serve`, for bench/serve_load.py.

Place in the data flow: a peer outside ParaFlex, in the benchmark's own process.
`transformers_model` builds SmolLM2-135M as a `LlamaForCausalLM` in float32 from the same
dequantised GGUF weights ParaFlex loads (bench/vllm_peer.py exports it for the vLLM peer too);
`transformers_tok_s` times `generate` at a batch (greedy, exactly the requested new tokens).
"""

from __future__ import annotations

import time


def transformers_model():
    """SmolLM2-135M as a `transformers` LlamaForCausalLM (fp32) with the same weights ParaFlex loads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paraflex.models.catalog import get_arch
    from paraflex.engine.worker.weights import load_stage_weights

    arch = get_arch("smollm2-135m")
    cfg = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                      intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                      num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                      head_dim=arch.head_dim, max_position_embeddings=arch.max_context,
                      rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                      tie_word_embeddings=arch.tie_embeddings)
    # eager attention: torch's CPU flash-attention kernel (the "sdpa" default) spends ~24 ms per
    # one-token decode call at this shape on this machine, which would make the peer a straw man
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    weights = load_stage_weights("smollm2-135m", arch, 0, arch.num_layers, dtype=torch.float32)
    missing, _ = model.load_state_dict(weights, strict=False)
    assert all(k == "lm_head.weight" for k in missing), missing
    return model


def transformers_tok_s(model, prompts: list[list[int]], out_len: int, batch: int, threads: int) -> float:
    """Output tok/s of `generate` at `batch` with `threads` torch threads (greedy, exactly
    out_len new tokens each)."""
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts[:batch])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * batch / wall
