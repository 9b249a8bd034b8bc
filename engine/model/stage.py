"""One pipeline stage of one model: [embeddings if first] + blocks [a, b) + [final norm and
LM head if last].

Place in the data flow: the worker keeps one `Stage` per (model, stage) resident on its
engine. A first stage takes token ids, later stages take the hidden states the previous
engine sent; a non-last stage returns hidden states for the next hop, the last stage returns
the logits of every request's last new token (the sampler picks the next token from them).
Weights arrive as a dict with HF tensor names (see `paraflex.engine.weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraflex.engine.attention import AttentionMetadata
from paraflex.engine.model.layers import DecoderLayer, rms_norm
from paraflex.engine.model.rope import Rotary


class Stage:
    def __init__(
        self,
        arch,
        layer_start: int,
        layer_end: int,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        if getattr(arch, "linear_bias", False) or not getattr(arch, "gated_mlp", True):
            raise NotImplementedError(
                f"{arch.name}: only Llama-family decoders (RMSNorm, SwiGLU) run on the torch engine"
            )
        self.arch = arch
        self.layer_start, self.layer_end = layer_start, layer_end
        self.first = layer_start == 0
        self.last = layer_end == arch.num_layers
        self.device = torch.device(device)
        self.layers = [
            DecoderLayer(
                arch, i - layer_start,
                {k[len(f"model.layers.{i}."):]: v for k, v in weights.items()
                 if k.startswith(f"model.layers.{i}.")},
            )
            for i in range(layer_start, layer_end)
        ]
        self.embed = weights.get("model.embed_tokens.weight") if self.first else None
        self.norm = weights["model.norm.weight"] if self.last else None
        # LM head stored transposed ([hidden, vocab]) like the layers' projections (one-row
        # products stream it ~1.7x faster); a tied table is stored once: the embedding
        # lookup reads rows of the transposed copy's view.
        self.lm_head_t = None
        if self.last:
            head = weights.get("lm_head.weight")
            tied = head is None
            self.lm_head_t = (weights["model.embed_tokens.weight"] if tied else head).t().contiguous()
            if tied and self.first:
                self.embed = self.lm_head_t.t()
        ref = self.embed if self.embed is not None else self.layers[0].qkv_t if self.layers else self.norm
        self.dtype = ref.dtype
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling, self.device)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def weight_bytes(self) -> int:
        """Bytes of the distinct weight tensors this stage holds (tied tables counted once)."""
        seen, total = set(), 0
        ts = [t for layer in self.layers for t in layer.tensors()]
        ts += [t for t in (self.embed, self.norm, self.lm_head_t) if t is not None]
        for t in ts:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor) -> torch.Tensor:
        """inputs: token ids [T] (first stage) or hidden states [T, H]. Returns hidden [T, H]
        or, on the last stage, float32 logits [B, vocab] of each request's last new token."""
        x = F.embedding(inputs, self.embed) if self.first else inputs.to(self.dtype)
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)
        for layer in self.layers:
            x = layer.forward(x, cos, sin, kv, meta)
        if not self.last:
            return x
        x = rms_norm(x[meta.last_token_index], self.norm, self.arch.rms_norm_eps)
        return torch.mm(x, self.lm_head_t).float()
