"""Building blocks of a Llama-family decoder layer: RMSNorm, attention with GQA and optional
QKV bias (Qwen2), SwiGLU MLP.

Place in the data flow: `Stage` owns a list of `DecoderLayer`s, one per layer of its range,
and calls them in order on the packed tokens of a batch. Projections are fused at load time
(Q|K|V and gate|up) so each layer is four matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraflex.engine.attention import AttentionMetadata, paged_attention
from paraflex.engine.model.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like the reference implementation, cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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
        self.qkv = torch.cat(
            [w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]]
        )
        self.qkv_bias = (
            torch.cat([w["self_attn.q_proj.bias"], w["self_attn.k_proj.bias"], w["self_attn.v_proj.bias"]])
            if "self_attn.q_proj.bias" in w
            else None
        )
        self.o_proj = w["self_attn.o_proj.weight"]
        self.gate_up = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
        self.down = w["mlp.down_proj.weight"]

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.input_norm, self.post_norm, self.qkv, self.o_proj, self.gate_up, self.down]
        return ts + ([self.qkv_bias] if self.qkv_bias is not None else [])

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv, self.index, meta, self.scale)
        x = x + F.linear(attn, self.o_proj)
        h = rms_norm(x, self.post_norm, self.eps)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)
