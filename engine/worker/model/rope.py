"""Rotary position embeddings (RoPE) for the Llama family, incl. Llama-3 and linear scaling.

Place in the data flow: each attention layer of a `Stage` rotates its queries and keys by the
absolute positions of the tokens in the batch before they are written to the KV pool. The
rotation follows the HF "rotate half" convention (GGUF llama weights are un-permuted to it
at load time by `paraflex.engine.worker.weights.gguf_loader`).
"""

from __future__ import annotations

import math

import torch

from paraflex.errors import UserError


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32, head_dim/2) after the model's rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise UserError(
        f"rope_scaling.rope_type: {kind!r} is not supported; use a model with "
        "'default', 'linear' or 'llama3' rope scaling"
    )


class Rotary:
    """Cos/sin tables for positions, computed in float32 and cast to the activation dtype."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device) -> None:
        self.inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, signed sin), each [tokens, 1, head_dim]: the signed sin is -sin on the first
        half, so that `apply_rotary` needs one `roll` instead of slicing, negating and joining."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by `Rotary.cos_sin` [tokens, 1, head_dim]:
    x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), computed exactly (sign
    flips are exact) as roll(x) * signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
