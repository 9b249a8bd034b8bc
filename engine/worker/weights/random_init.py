"""Deterministic random weights for the tiny demo models (tiny-2l/4l/8l), so the demo needs
no files.

Every tensor is drawn from its own generator seeded with crc32("<built-in name>/<tensor name>"):
the same built-in name always gives the same weights, and a stage that loads layers [a, b)
gets exactly the tensors a single-stage copy of the model would hold, so any cut of the model
computes the same function. Matrices ~ N(0, 0.02^2) like HF's default init (embeddings a
bit larger so the demo output is not flat); norm weights are 1.
"""

from __future__ import annotations

import zlib

import torch

from paraflex.engine.worker.weights.names import stage_tensor_shapes


def random_stage_weights(seed_name: str, arch, layer_start: int, layer_end: int, dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in stage_tensor_shapes(arch, layer_start, layer_end).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed_name}/{name}".encode()))
        std = 1.0 if name == "model.embed_tokens.weight" else 0.02
        if name.endswith(".bias"):
            std = 0.02
        out[name] = (torch.randn(shape, generator=gen) * std).to(dtype=dtype, device=device)
    return out
