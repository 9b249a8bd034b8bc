"""One pipeline stage of one model: [embeddings if first] + blocks [a, b) + [final norm and
LM head if last].

Place in the data flow: the worker keeps one `Stage` per (model, stage) resident on its
engine. A first stage takes token ids, later stages take the hidden states the previous
engine sent; a non-last stage returns hidden states for the next hop, the last stage returns
the logits of every request's last new token (the sampler picks the next token from them).
Weights arrive as a dict with HF tensor names (see `paraflex.engine.worker.weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.model.layer_ops import rms_norm
from paraflex.engine.worker.model.layers import DecoderLayer, unsupported_reason
from paraflex.engine.worker.model.linear import Linear
from paraflex.engine.worker.model.rope import Rotary


class Stage:
    def __init__(
        self,
        arch,
        layer_start: int,
        layer_end: int,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        reason = unsupported_reason(arch)
        if reason:
            raise NotImplementedError(reason)
        self.arch = arch
        self.layer_start, self.layer_end = layer_start, layer_end
        self.first = layer_start == 0
        self.last = layer_end == arch.num_layers
        self.device = torch.device(device)
        self.layers = [DecoderLayer.from_checkpoint(arch, i - layer_start, i, weights)
                       for i in range(layer_start, layer_end)]
        self.embed = weights.get("model.embed_tokens.weight") if self.first else None
        self.norm = weights["model.norm.weight"] if self.last else None
        # The LM head multiplies like the layers' projections (`Linear`). A tied table is also
        # the embedding: kept once where the head's layout can give rows back (the embedding
        # reads them from the head); oneDNN's opaque layout needs the table beside it.
        self.lm_head, self.head_is_embed = None, False
        if self.last:
            head = weights.get("lm_head.weight")
            tied = head is None
            self.lm_head = Linear(weights["model.embed_tokens.weight"] if tied else head, prefill=False)
            if tied and self.first and self.lm_head.holds_rows:
                self.embed, self.head_is_embed = None, True
        ref = self.embed if self.embed is not None else self.norm
        self.dtype = ref.dtype if ref is not None else self.layers[0].input_norm.dtype
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling, self.device)

    @property
    def packed(self) -> bool:
        """Whether the projections use a packed CPU layout (compiled panels or oneDNN; see `Linear`)."""
        linears = [layer.qkv for layer in self.layers] + ([self.lm_head] if self.lm_head else [])
        return any(lin.weight_t is None for lin in linears)

    def projection_layouts(self) -> str:
        """Each projection shape's layout (`Linear`), with the chooser's verdict where it chose."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        seen = {}
        for lin in linears + ([self.lm_head] if self.lm_head else []):
            shape = f"{lin.out_features}x{lin.in_features}"
            seen.setdefault(shape, lin.verdict.describe() if lin.verdict else lin.layout)
        return "; ".join(f"{shape} {what}" for shape, what in seen.items())

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def weight_bytes(self) -> int:
        """Bytes of the weights this stage holds (a table shared by embedding and head counted once)."""
        total = sum(layer.weight_bytes() for layer in self.layers)
        total += sum(t.numel() * t.element_size() for t in (self.embed, self.norm) if t is not None)
        if self.lm_head is not None:  # with a tied table read through the head, this is the table
            total += self.lm_head.nbytes
        return total

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor) -> torch.Tensor:
        """inputs: token ids [T] (first stage) or hidden states [T, H]. Returns hidden [T, H]
        or, on the last stage, float32 logits [B, vocab] of each request's last new token."""
        if not self.first:
            x = inputs.to(self.dtype)
        else:
            x = self.lm_head.rows(inputs) if self.head_is_embed else F.embedding(inputs, self.embed)
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)
        mlp_out = None
        for layer in self.layers:
            x, mlp_out = layer.forward(x, cos, sin, kv, meta, mlp_out)
        if not self.last:
            return mlp_out.add_(x) if mlp_out is not None else x
        rows = meta.last_token_index
        x = x[rows] + mlp_out[rows] if mlp_out is not None else x[rows]
        x = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return self.lm_head(x).float()
