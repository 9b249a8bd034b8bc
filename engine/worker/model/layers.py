"""Building blocks of a Llama-family decoder layer: RMSNorm, attention with GQA and optional
QKV bias (Qwen2), SwiGLU MLP.

Place in the data flow: `Stage` owns a list of `DecoderLayer`s, one per layer of its range,
and calls them in order on the packed tokens of a batch, passing each layer's MLP output to the
next (whose first norm adds it to the residual stream). Projections are fused at load time
(Q|K|V and gate|up) so each layer is four matmuls, each a `Linear` (engine/worker/model/linear.py:
packed weights and a compiled kernel on CPU, transposed weights for `torch.mm` elsewhere).
"""

from __future__ import annotations

import torch

from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.model.layer_ops import add_rms_norm, rms_norm, rotate_queries_keys, silu_mul
from paraflex.engine.worker.model.linear import Linear


def unsupported_reason(arch) -> str | None:
    """Why `DecoderLayer` cannot run `arch` (None when it can: a Llama-family decoder)."""
    if getattr(arch, "linear_bias", False) or not getattr(arch, "gated_mlp", True):
        return f"{arch.name}: only Llama-family decoders (RMSNorm, SwiGLU) run on the torch engine"
    return None


class DecoderLayer:
    """One transformer block. `index` is the layer number inside the stage (0-based), used to
    pick the layer's block table."""

    def __init__(self, arch, index: int, w: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim,
        )
        self.eps = arch.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        qkv_bias = (
            torch.cat([w["self_attn.q_proj.bias"], w["self_attn.k_proj.bias"], w["self_attn.v_proj.bias"]])
            if "self_attn.q_proj.bias" in w
            else None
        )
        self.qkv = Linear(
            torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]]),
            qkv_bias,
        )
        self.o_proj = Linear(w["self_attn.o_proj.weight"])
        self.gate_up = Linear(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        self.down = Linear(w["mlp.down_proj.weight"])

    @classmethod
    def from_checkpoint(cls, arch, index: int, layer: int, weights: dict[str, torch.Tensor]) -> "DecoderLayer":
        """Layer `layer` of the model (HF tensor names ``model.layers.<layer>.*`` in `weights`),
        as layer `index` of its stage."""
        prefix = f"model.layers.{layer}."
        return cls(arch, index, {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})

    def weight_bytes(self) -> int:
        norms = sum(t.numel() * t.element_size() for t in (self.input_norm, self.post_norm))
        return norms + sum(p.nbytes for p in (self.qkv, self.o_proj, self.gate_up, self.down))

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttentionMetadata,
                mlp_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering the layer is `x`, or `x` + `mlp_out` (the previous
        layer's MLP output, added here together with the norm). Returns (stream after the
        attention block, this layer's MLP output): the caller adds them (or passes them on)."""
        if mlp_out is None:
            h = rms_norm(x, self.input_norm, self.eps)
        else:
            h = add_rms_norm(mlp_out, x, self.input_norm, self.eps)
            x = mlp_out
        qkv = self.qkv(h)
        t = x.shape[0]
        # queries and keys are adjacent columns: one rotation for both
        qk = rotate_queries_keys(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv, self.index, meta, self.scale)
        stream = self.o_proj(attn)
        h = add_rms_norm(stream, x, self.post_norm, self.eps)
        return stream, self.down(silu_mul(self.gate_up(h)))
