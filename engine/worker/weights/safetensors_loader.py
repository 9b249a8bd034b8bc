"""Load one stage's tensors from an HF safetensors directory (single file or sharded index).

Place in the data flow: `paraflex.engine.worker.weights.load_stage_weights` calls this for `hf:`
sources; only the tensors of the stage's layer range are read from disk (safetensors is
memory-mapped, so other layers are never touched).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from paraflex.engine.worker.weights.names import stage_tensor_shapes
from paraflex.errors import UserError


def _weight_map(directory: str) -> dict[str, str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, "model.safetensors")
    if not os.path.exists(single):
        raise UserError(
            f"{directory}: no model.safetensors or model.safetensors.index.json; "
            "point the model's source at an HF directory saved with safetensors"
        )
    with safe_open(single, framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


def load_safetensors_stage(directory, arch, layer_start, layer_end, dtype, device) -> dict[str, torch.Tensor]:
    shapes = stage_tensor_shapes(arch, layer_start, layer_end)
    wmap = _weight_map(directory)
    by_file: dict[str, list[str]] = {}
    for name in shapes:
        if name not in wmap:
            raise UserError(
                f"{directory}: tensor {name!r} missing for {arch.name}; the checkpoint does not "
                "match its config.json"
            )
        by_file.setdefault(wmap[name], []).append(name)
    out = {}
    for fname, names in by_file.items():
        with safe_open(os.path.join(directory, fname), framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if tuple(t.shape) != shapes[name]:
                    raise UserError(
                        f"{directory}: tensor {name!r} has shape {tuple(t.shape)}, "
                        f"config.json implies {shapes[name]}"
                    )
                out[name] = t.to(dtype=dtype, device=device)
    return out
