"""paraflex.engine.weights: load the tensors of one stage (a layer range of one model).

Place in the data flow: the runtime builds each engine's resident `Stage`s from a placement;
for every stage it calls `load_stage_weights(source, arch, a, b, dtype, device)`, which reads
only that stage's share from the model's source:

* ``hf:DIR`` or a directory: HF safetensors (single file or sharded index);
* ``gguf:FILE`` or a ``*.gguf`` path: GGUF, dequantized;
* no source for a tiny demo model (``tiny-*``): deterministic random weights seeded by the
  model name (`random_init`).
"""

from __future__ import annotations

import os

import torch

from paraflex.errors import UserError


def resolve_source(source: str | None, model_name: str) -> tuple[str, str]:
    """(kind, location) with kind in {"hf", "gguf", "random"}."""
    if not source or source.strip().lower() == model_name.lower():
        if model_name.lower().startswith("tiny-"):
            return "random", model_name
        raise UserError(
            f"model {model_name!r} has no weights source; set its `source` to hf:DIR or "
            "gguf:FILE (only the tiny-* demo models run without files)"
        )
    if source.startswith("hf:"):
        kind, loc = "hf", source[3:]
    elif source.startswith("gguf:"):
        kind, loc = "gguf", source[5:]
    elif source.lower().endswith(".gguf"):
        kind, loc = "gguf", source
    elif os.path.isdir(source):
        kind, loc = "hf", source
    elif source.lower().startswith("tiny-"):
        return "random", source
    else:
        raise UserError(
            f"model {model_name!r}: source {source!r} is neither an HF directory nor a .gguf "
            "file; use hf:DIR or gguf:FILE"
        )
    loc = os.path.expanduser(loc)
    if not os.path.exists(loc):
        raise UserError(f"model {model_name!r}: source {loc!r} does not exist; fix its path")
    return kind, loc


def load_stage_weights(source, arch, layer_start, layer_end, dtype=torch.float32, device="cpu"):
    """HF-named tensors of layers [layer_start, layer_end) (+ embeddings/head as needed)."""
    kind, loc = resolve_source(source, arch.name)
    if kind == "random":
        from paraflex.engine.weights.random_init import random_stage_weights

        return random_stage_weights(arch, layer_start, layer_end, dtype, device)
    if kind == "hf":
        from paraflex.engine.weights.safetensors_loader import load_safetensors_stage

        return load_safetensors_stage(loc, arch, layer_start, layer_end, dtype, device)
    from paraflex.engine.weights.gguf_loader import load_gguf_stage

    return load_gguf_stage(loc, arch, layer_start, layer_end, dtype, device)
