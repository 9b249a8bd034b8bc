"""Building blocks of a Llama-family decoder layer: RMSNorm, attention with GQA and optional
QKV bias (Qwen2), SwiGLU MLP.

Place in the data flow: `Stage` owns a list of `DecoderLayer`s, one per layer of its range,
and calls them in order on the packed tokens of a batch. Projections are fused at load time
(Q|K|V and gate|up) so each layer is four matmuls. The Q|K|V, O and gate|up weights are stored
transposed ([in, out], contiguous) and multiplied with `torch.mm`: on CPU, MKL's one-row
(decode at batch 1) product streams that layout 1.4-1.6x faster than `F.linear` over the
[out, in] checkpoint layout (measured for SmolLM2's shapes, equal at 32+ rows); the down
projection ([576, 1536]-like, long rows) is as fast or faster as [out, in], so it stays.
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
        self.qkv_t = torch.cat(
            [w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]]
        ).t().contiguous()
        self.qkv_bias = (
            torch.cat([w["self_attn.q_proj.bias"], w["self_attn.k_proj.bias"], w["self_attn.v_proj.bias"]])
            if "self_attn.q_proj.bias" in w
            else None
        )
        self.o_proj_t = w["self_attn.o_proj.weight"].t().contiguous()
        self.gate_up_t = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]).t().contiguous()
        self.down = w["mlp.down_proj.weight"]

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.input_norm, self.post_norm, self.qkv_t, self.o_proj_t, self.gate_up_t, self.down]
        return ts + ([self.qkv_bias] if self.qkv_bias is not None else [])

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = torch.mm(h, self.qkv_t) if self.qkv_bias is None else torch.addmm(self.qkv_bias, h, self.qkv_t)
        t, qk_size = x.shape[0], self.q_size + self.kv_size
        # queries and keys are adjacent columns: one rotation for both
        qk = apply_rotary(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv, self.index, meta, self.scale)
        x = x + torch.mm(attn, self.o_proj_t)
        h = rms_norm(x, self.post_norm, self.eps)
        gate, up = torch.mm(h, self.gate_up_t).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate).mul_(up), self.down)
