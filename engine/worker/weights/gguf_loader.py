"""Load one stage's tensors from a GGUF file, dequantized with the `gguf` package.

Place in the data flow: `paraflex.engine.worker.weights.load_stage_weights` calls this for `gguf:`
sources. Only the stage's tensors are dequantized (the file is memory-mapped). Every type the
`gguf` package can dequantize works; tested with F32, F16, Q8_0, Q4_1 (SmolLM2's file uses
Q4_1 + Q8_0 + F32). llama.cpp's converter permutes Q and K rows of `llama` models for its
interleaved rotary layout; they are permuted back to the HF "rotate half" layout here.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

from paraflex.engine.worker.weights.names import stage_tensor_shapes
from paraflex.errors import UserError

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str):
    """A GGUFReader for `path`, shared within the process (parsing the header of a 49k-token
    vocabulary takes seconds; the tensor data stays memory-mapped)."""
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, _size: int, _mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/struct errors on a bad file
        raise UserError(f"cannot read GGUF file {path}: {exc}") from None


def load_gguf_stage(path, arch, layer_start, layer_end, dtype, device) -> dict[str, torch.Tensor]:
    import gguf

    reader = open_gguf(path)
    arch_field = reader.fields.get("general.architecture")
    model_arch = arch_field.contents() if arch_field is not None else "llama"
    shapes = stage_tensor_shapes(arch, layer_start, layer_end)
    tensors = {hf_name(t.name): t for t in reader.tensors}
    out = {}
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise UserError(f"{path}: tensor for {name!r} missing; is this a Llama-family GGUF?")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(
                f"{path}: tensor {t.name} uses quantization {t.tensor_type.name}, which the "
                "installed gguf package cannot dequantize; use an F16/Q8_0/Q4_x file"
            ) from None
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if model_arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rotary(w, arch.num_heads)
        elif model_arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rotary(w, arch.num_kv_heads)
        w = np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable)
        out[name] = torch.from_numpy(w).to(dtype=dtype, device=device)
    return out
