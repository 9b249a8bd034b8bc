"""Which tensors (HF names) one stage needs, and their shapes from the `ModelArch`.

Place in the data flow: every weight loader (safetensors, GGUF, random demo weights) asks this
module for the tensor list of a stage's layer range, so a stage reads only its share.
"""

from __future__ import annotations


def layer_tensor_shapes(arch, layer: int) -> dict[str, tuple[int, ...]]:
    h, f = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    p = f"model.layers.{layer}."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (f, h),
        p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f),
    }
    if arch.qkv_bias:
        shapes[p + "self_attn.q_proj.bias"] = (q,)
        shapes[p + "self_attn.k_proj.bias"] = (kv,)
        shapes[p + "self_attn.v_proj.bias"] = (kv,)
    return shapes


def stage_tensor_shapes(arch, layer_start: int, layer_end: int) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the stage holding layers [layer_start, layer_end)."""
    if not 0 <= layer_start < layer_end <= arch.num_layers:
        raise ValueError(
            f"{arch.name}: stage layer range [{layer_start}, {layer_end}) is not inside "
            f"0..{arch.num_layers}"
        )
    first, last = layer_start == 0, layer_end == arch.num_layers
    shapes: dict[str, tuple[int, ...]] = {}
    if first or (last and arch.tie_embeddings):
        shapes["model.embed_tokens.weight"] = (arch.vocab_size, arch.hidden_size)
    for layer in range(layer_start, layer_end):
        shapes.update(layer_tensor_shapes(arch, layer))
    if last:
        shapes["model.norm.weight"] = (arch.hidden_size,)
        if not arch.tie_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return shapes
