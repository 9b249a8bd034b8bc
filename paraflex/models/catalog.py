"""Model catalog: architecture facts of a decoder-only LLM and the sizes derived from them.

Place in the data flow: the config loader (`paraflex.config.schema`) turns every model entry into a
`ModelArch` (from a built-in name, an HF ``config.json`` or a GGUF header); the cost model,
the planner (weight and KV bytes per stage), the KV block pool (bytes per token per layer)
and the simulator read only this dataclass.

Byte accounting (all in bytes, ``dtype_bytes`` per parameter):

* a transformer layer holds Q/K/V/O projections, the MLP (gate+up+down when ``gated_mlp``,
  else up+down) and two norms (RMSNorm: weight only; ``linear_bias`` models like Phi-2 use
  LayerNorm with bias and biases on every linear);
* ``embedding_bytes()`` is the input token-embedding table (lives on the first stage);
* ``head_bytes()`` is the final norm plus the LM-head matrix. With tied embeddings the head
  matrix IS the embedding table, so ``head_bytes()`` is only the final norm and
  ``weight_bytes()`` counts the table once; a last stage that is not also the first stage
  still needs its own copy of the table, which ``stage_weight_bytes`` adds.

No torch import here. Reading an architecture from an HF ``config.json`` or a GGUF header is
paraflex/models/arch_files.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paraflex.errors import UserError


@dataclass(frozen=True)
class ModelArch:
    """Architecture of one decoder-only transformer (Llama family and close relatives)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int = 4096
    dtype_bytes: int = 2
    tie_embeddings: bool = False
    qkv_bias: bool = False
    gated_mlp: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)
    linear_bias: bool = False  # biases on every linear + LayerNorm bias (Phi-2)
    parallel_block: bool = False  # attention and MLP read one shared norm (Phi-2)
    # Why the engine cannot run this checkpoint (a config.json setting it does not implement;
    # paraflex/models/engine_support.py), None when it can. Not a size: the simulator ignores it.
    unsupported: str | None = None

    # ---- parameter counts -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias or self.linear_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = (1 if self.parallel_block else 2) * h
        if self.linear_bias:
            attn += h  # output-projection bias
            mlp += f * (2 if self.gated_mlp else 1) + h
            norms *= 2  # LayerNorm biases
        return attn + mlp + norms

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm + LM head; the head matrix is not counted again when tied."""
        norm = self.hidden_size * (2 if self.linear_bias else 1)
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        if self.linear_bias and not self.tie_embeddings:
            head += self.vocab_size
        return norm + head

    def num_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    # ---- bytes -------------------------------------------------------------------------
    def layer_weight_bytes(self) -> int:
        return self.layer_params() * self.dtype_bytes

    def embedding_bytes(self) -> int:
        return self.embedding_params() * self.dtype_bytes

    def head_bytes(self) -> int:
        return self.head_params() * self.dtype_bytes

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes

    def stage_weight_bytes(self, layer_start: int, layer_end: int, first: bool, last: bool) -> int:
        """Weights resident on a stage holding layers [layer_start, layer_end)."""
        if not 0 <= layer_start <= layer_end <= self.num_layers:
            raise ValueError(
                f"{self.name}: layer range [{layer_start}, {layer_end}) outside 0..{self.num_layers}"
            )
        total = (layer_end - layer_start) * self.layer_weight_bytes()
        if first:
            total += self.embedding_bytes()
        if last:
            total += self.head_bytes()
            if self.tie_embeddings and not first:
                total += self.embedding_bytes()  # own copy of the tied table for the LM head
        return total

    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer()

    def flops_per_token(self) -> int:
        """Dense matmul FLOPs of one token through the whole model (2 per weight; no attention
        score FLOPs, which depend on the context: see `paraflex.costs.costmodel`)."""
        norms = (1 if self.parallel_block else 2) * self.hidden_size * (2 if self.linear_bias else 1)
        matmul = self.num_layers * (self.layer_params() - norms)
        return 2 * (matmul + self.vocab_size * self.hidden_size)

    def with_dtype_bytes(self, dtype_bytes: int) -> "ModelArch":
        return replace(self, dtype_bytes=dtype_bytes)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if self.unsupported is None:
            del d["unsupported"]
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d


def _llama(name, layers, hidden, ffn, heads, kv_heads, vocab, ctx, **kw) -> ModelArch:
    return ModelArch(
        name=name, num_layers=layers, hidden_size=hidden, intermediate_size=ffn,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        vocab_size=vocab, max_context=ctx, **kw,
    )


# Numbers from each model's published HF config.json.
_BUILTINS: dict[str, ModelArch] = {
    a.name: a
    for a in [
        _llama("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
        _llama("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
        _llama("codellama-34b-instruct", 48, 8192, 22016, 64, 8, 32000, 16384, rope_theta=1e6),
        _llama("internlm2.5-20b-chat", 48, 6144, 16384, 48, 8, 92544, 32768, rope_theta=5e7),
        _llama("phi-2", 32, 2560, 10240, 32, 32, 51200, 2048, gated_mlp=False,
               linear_bias=True, qkv_bias=True, parallel_block=True),
        # Qwen-72B (v1): config intermediate_size 49152 = 2 x the real FFN width (w1, w2 each 24576).
        _llama("qwen-72b", 80, 8192, 24576, 64, 64, 152064, 32768, qkv_bias=True,
               rope_theta=1e6, rms_norm_eps=1e-6),
        _llama("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, rope_theta=5e5),
        _llama("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, rope_theta=5e5),
        # Synthetic depth-scaled models of the paper's section 8.4: Llama-2-7B width.
        _llama("llama-20b", 60, 4096, 11008, 32, 32, 32000, 4096),
        _llama("llama-40b", 120, 4096, 11008, 32, 32, 32000, 4096),
        _llama("llama-80b", 240, 4096, 11008, 32, 32, 32000, 4096),
        _llama("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, tie_embeddings=True,
               rope_theta=1e5),
        # Tiny random-weight demo models (CPU, float32): byte vocab 256 + bos/eos/pad.
        _llama("tiny-2l", 2, 64, 192, 4, 2, 259, 2048, dtype_bytes=4),
        _llama("tiny-4l", 4, 96, 256, 6, 2, 259, 2048, dtype_bytes=4),
        _llama("tiny-8l", 8, 128, 384, 8, 4, 259, 2048, dtype_bytes=4),
    ]
}


def builtin_names() -> list[str]:
    return list(_BUILTINS)


def get_arch(name: str) -> ModelArch:
    """Built-in architecture by name (case-insensitive)."""
    try:
        return _BUILTINS[name.strip().lower()]
    except KeyError:
        raise UserError(
            f"unknown built-in model {name!r}; choose one of: {', '.join(_BUILTINS)} "
            "(or give an HF directory with `hf:` or a GGUF file with `gguf:`)"
        ) from None
