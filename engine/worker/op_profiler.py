"""Time the torch engine's per-layer ops on the device at hand, in Vidur's ``mlp.csv`` rows.

Place in the data flow: `paraflex profile` calls `profile_layer_ops` for every distinct model
shape of a config; `paraflex.costs.profile_tables.write_mlp_csv` writes the rows; a config that
points `cluster.profile_dir` at the result makes the cost model (planner, simulator) use these
measured times instead of its roofline for the linear and elementwise ops of a layer
(attention keeps the roofline).

The ops are the engine's own code on random weights of the model's shape and dtype (one
decoder layer plus the embedding table): `emb` the embedding lookup, `input_layernorm` /
`post_attention_layernorm` the residual add with the RMSNorm after it (the engine fuses them),
`attn_pre_proj` the fused Q|K|V `Linear`, `attn_rope` the rotation of queries and keys,
`attn_post_proj` the O `Linear`, `mlp_up_proj` the fused gate|up `Linear`, `mlp_act` SiLU(gate)
* up, `mlp_down_proj` the down `Linear`, `add` one residual add as a separate op (the engine
runs one per stage; the cost model's two per layer over-count by that much where the norms
include them). Each is run `warmup` times, then timed `repeats` times (synchronised on CUDA).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from paraflex.engine.worker.model.layer_ops import add_rms_norm, rotate_queries_keys, silu_mul
from paraflex.engine.worker.model.layers import DecoderLayer
from paraflex.engine.worker.model.rope import Rotary
from paraflex.engine.worker.weights.random_init import random_stage_weights
from paraflex.costs.profile_tables import ALL_OPS

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def _stats_ms(samples: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in samples]
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms), "median": statistics.median(ms),
            "std": statistics.pstdev(ms)}


def profile_layer_ops(arch, device: torch.device, dtype: torch.dtype, tokens=DEFAULT_TOKENS, *,
                      repeats: int = 10, warmup: int = 2, progress=None) -> list[dict]:
    """One row per token count: ``time_stats.<op>.<stat>`` in milliseconds for every op of
    `ALL_OPS`, plus Vidur's shape columns (TP 1)."""
    w = random_stage_weights(f"profile/{arch.name}", arch, 0, 1, dtype, device)
    layer = DecoderLayer.from_checkpoint(arch, 0, 0, w)
    table = w["model.embed_tokens.weight"]
    rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling, device)
    now = _timer(device)
    heads = arch.num_heads + arch.num_kv_heads
    rows = []
    for n in tokens:
        g = torch.Generator(device=device).manual_seed(n)
        ids = torch.randint(0, arch.vocab_size, (n,), device=device, generator=g)
        x = torch.randn(n, arch.hidden_size, device=device, generator=g).to(dtype)
        attn = torch.randn(n, arch.num_heads * arch.head_dim, device=device, generator=g).to(dtype)
        stream = torch.randn(n, arch.hidden_size, device=device, generator=g).to(dtype)
        gate_up = torch.randn(n, 2 * arch.intermediate_size, device=device, generator=g).to(dtype)
        act = torch.randn(n, arch.intermediate_size, device=device, generator=g).to(dtype)
        qkv = torch.randn(n, (heads + arch.num_kv_heads) * arch.head_dim, device=device, generator=g).to(dtype)
        cos, sin = rotary.cos_sin(torch.arange(n, device=device), dtype)

        ops = {
            "emb": lambda: F.embedding(ids, table),
            "input_layernorm": lambda: add_rms_norm(stream, x, layer.input_norm, layer.eps),
            "attn_pre_proj": lambda: layer.qkv(x),
            "attn_rope": lambda: rotate_queries_keys(qkv, heads, arch.head_dim, cos, sin),
            "attn_post_proj": lambda: layer.o_proj(attn),
            "post_attention_layernorm": lambda: add_rms_norm(stream, x, layer.post_norm, layer.eps),
            "mlp_up_proj": lambda: layer.gate_up(x),
            "mlp_act": lambda: silu_mul(gate_up),
            "mlp_down_proj": lambda: layer.down(act),
            "add": lambda: x + x,
        }
        row: dict = {}
        with torch.inference_mode():
            for op in ALL_OPS:
                fn = ops[op]
                for _ in range(warmup):
                    fn()
                samples = []
                for _ in range(repeats):
                    t0 = now()
                    fn()
                    samples.append(now() - t0)
                for stat, value in _stats_ms(samples).items():
                    row[f"time_stats.{op}.{stat}"] = value
        row.update(n_head=arch.num_heads, n_kv_head=arch.num_kv_heads, n_embd=arch.hidden_size,
                   n_expanded_embd=arch.intermediate_size, vocab_size=arch.vocab_size,
                   use_gated_mlp=arch.gated_mlp, num_tokens=n, num_tensor_parallel_workers=1)
        rows.append(row)
        if progress:
            layer_ms = sum(row[f"time_stats.{op}.median"] for op in ALL_OPS if op != "emb")
            progress(f"{arch.name}: {n} tokens: one layer's linear/elementwise ops {layer_ms:.3f} ms")
    return rows
