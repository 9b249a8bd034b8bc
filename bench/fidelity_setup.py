"""What bench/sim_fidelity.py serves and simulates: the config, the models and the requests' shape.

Place in the data flow: sim_fidelity.py asks `build_setup(backend, shapes, out)` for a `Setup`,
writes its config next to the results, plans it, serves it and simulates it; every request list
it generates takes its models, lengths and token ids from the Setup. Two backends:

* `ray` (the default, as users run a cluster): the built-in tiny models on two engines, tiny-8l
  cut into two stages on different engines and both engines holding stages of several models;
* `in-process` (`paraflex serve --in-process`, where Ray is not installed, e.g. a GPU machine
  here): one engine holding every model whole. The in-process runtime steps all engines from one
  thread, so two engines in one process are not two devices, and one engine is what the
  simulator can be held against there.

Three kinds of model (`shapes`): `builtin` (tiny-2l/4l/8l of the catalog), `random-real`
(random-weight Llama checkpoints of real shapes, ~0.4-1.1B parameters, built on the fly: for a
GPU) and `random-small` (the same three built at toy sizes: the GPU path dry-run on a CPU). A
random checkpoint's tokenizer is a word-level vocabulary of the model's full size, so every
token id a prompt or the model produces decodes. On a CUDA machine the cluster's `device` is the
catalog name of the GPU at hand (`h100-80g`, `h200`, `a100-80g`), so that `paraflex profile`
measures the tables the simulator then reads for it.

bench/ is no package: sim_fidelity.py puts this folder on sys.path to import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

BUILTIN = ("tiny-2l", "tiny-4l", "tiny-8l")
# name -> Llama shape (hidden, ffn, layers, heads, kv heads, vocab): TinyLlama-1.1B, a
# Qwen2-0.5B-like and SmolLM2-360M's shapes (Llama layers throughout)
REAL_SHAPES = {
    "llama-1b-shape": (2048, 5632, 22, 32, 4, 32000),
    "qwen-0.5b-shape": (896, 4864, 24, 14, 2, 32000),
    "smollm2-360m-shape": (960, 2560, 32, 15, 5, 49152),
}
SMALL_SHAPES = {name: (64, 128, layers, 4, 2, 512) for name, layers in
                zip(REAL_SHAPES, (3, 2, 4))}
GPU_NAMES = (("H100", "h100-80g"), ("H200", "h200"), ("A100", "a100-80g"))


@dataclass(frozen=True)
class Setup:
    """One fidelity run's served configuration and the shape of its requests."""

    config: dict
    backend: str  # "ray" | "in-process"
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    token_ids: tuple[int, int]  # prompts draw token ids in [low, high)
    profile_tokens: str  # `paraflex profile --tokens`

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(m["name"] for m in self.config["models"])


def cluster_device() -> str:
    """The catalog device of the accelerator at hand: a CUDA GPU's name, else `cpu`."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for key, device in GPU_NAMES:
        if key in name:
            return device
    raise SystemExit(f"sim_fidelity: no cost-model device for the GPU {name!r}; known: "
                     f"{', '.join(k for k, _ in GPU_NAMES)}")


def build_setup(backend: str, shapes: str, out: str) -> Setup:
    """The Setup of `backend` over `shapes`; random checkpoints are written under out/checkpoints."""
    device = "cpu" if shapes == "builtin" else cluster_device()
    if shapes == "builtin":
        models = [{"name": m, "arch": m, "rate": 1} for m in BUILTIN]
        vocab = 250  # inside the tiny models' byte vocabulary
    else:
        table = REAL_SHAPES if shapes == "random-real" else SMALL_SHAPES
        models = [{"name": name, "hf": os.path.join("checkpoints", name), "rate": 1} for name in table]
        for seed, (name, shape) in enumerate(table.items()):  # relative to the config's folder, `out`
            random_checkpoint(os.path.join(out, "checkpoints", name), shape, seed)
        vocab = min(shape[-1] for shape in table.values())
    gpu = device != "cpu"
    config = {
        "name": "sim-fidelity",
        "cluster": {"num_engines": 2, "device": device, "tp": 1, "memory_gb": 60 if gpu else 1,
                    "host_memory_gb": 0.5, "interconnect_gbps": 10, "interconnect_latency_us": 50},
        "models": models,
        # 12 ms cuts tiny-8l (~18 ms on the `cpu` roofline) into two stages and keeps the others whole
        "planner": {"target_stage_time": 12, "ring": False, "kappa_gb": 0.05},
        "scheduler": {"max_batch_size": 64 if gpu else 8, "block_bytes": 32768, "policy": "full-batch-first"},
    }
    if backend == "in-process":  # one engine, every model whole (see the module docstring)
        config["cluster"]["num_engines"] = 1
        config["planner"]["target_stage_time"] = 100000
    long = shapes == "random-real"
    return Setup(config=config, backend=backend, prompt_range=(64, 768) if long else (8, 48),
                 output_range=(16, 96) if long else (8, 24), token_ids=(3, vocab),
                 profile_tokens=",".join(str(2 ** i) for i in range(13 if long else 9)))


def random_checkpoint(directory: str, shape: tuple, seed: int) -> None:
    """A bfloat16 Llama checkpoint of `shape` with weights drawn from `seed` and a word-level
    tokenizer of its whole vocabulary, in `directory` (kept when it already holds one)."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ffn, layers, heads, kv_heads, vocab = shape
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # drawn where it is fastest
        model = LlamaForCausalLM(config).to(dtype=torch.bfloat16, device="cpu").eval()
    model.save_pretrained(directory)
    word_tokenizer(directory, vocab)


def word_tokenizer(directory: str, vocab: int) -> None:
    """tokenizer.json + tokenizer_config.json: `vocab` words `<s>`, `</s>`, `<pad>`, `w3`, `w4`, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, fh)
