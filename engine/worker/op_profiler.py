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
include them). Each is run `warmup` times, then timed `repeats` times; on a CPU each timed sample
is the fastest of `BURST` calls back to back (a round), so the table's median is the median of
per-round minima (paraflex/costs/robust_timing.py: other tenants of a shared
machine only add time). An op costs no less at more tokens: where an op's median at fewer tokens
exceeds one at more by over 10%, both token counts are re-measured (up to `RETRIES` times, the
lower median kept), and a break left after that is pooled into a non-decreasing median column
(pool adjacent violators; min/max/mean/std stay as measured). `OpProfile` says what was
re-measured and adjusted, and the typical relative IQR of a point's samples (the noise).

On CUDA an op is timed as the engine runs it: `GRAPH_CALLS` calls captured in one CUDA graph,
each sample one replay between two CUDA events, divided by the calls. Decode steps replay
graphs, so their ops cost their kernels' time; timing each call alone between synchronisations
measured the launch and the sync instead (20-45 us per op on an H100 for ~5 us kernels: a 1B
model's decode step came out 7.4 ms against 2 ms served). What eager launches cost beyond that
(prefill steps, the host's work per step) is the step profiler's residual
(paraflex/serving/step_profiler.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from paraflex.engine.worker.model.layer_ops import add_rms_norm, rotate_queries_keys, silu_mul
from paraflex.engine.worker.model.layers import DecoderLayer
from paraflex.engine.worker.model.rope import Rotary
from paraflex.engine.worker.weights.random_init import random_stage_weights
from paraflex.costs.profile_tables import ALL_OPS
from paraflex.costs.robust_timing import MONOTONE_TOL, make_monotone, monotone_breaks

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BURST = 3  # calls per timed sample on a CPU (its fastest counts)
GRAPH_CALLS = 8  # calls per CUDA graph replay (one timed sample on CUDA)
RETRIES = 2  # re-measurements of a token count whose op breaks monotonicity


def _stats_ms(samples: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in samples]
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms), "median": statistics.median(ms),
            "std": statistics.pstdev(ms)}


def _relative_iqr(samples: list[float]) -> float:
    if len(samples) < 4:
        return (max(samples) - min(samples)) / statistics.median(samples)
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


@dataclass
class OpProfile:
    """The table rows of one model shape and how noisy they were: `spread` the median over the
    table's points of the relative IQR of their samples, `remeasured` / `adjusted` "op@tokens" of
    the points re-measured for a monotonicity break / moved by more than the tolerance when pooled
    into a non-decreasing median column."""

    rows: list[dict]
    spread: float = 0.0
    remeasured: list[str] = field(default_factory=list)
    adjusted: list[str] = field(default_factory=list)

    def noise(self) -> dict:
        return {"spread": round(self.spread, 4), "remeasured": self.remeasured, "adjusted": self.adjusted}


class _LayerOps:
    """The ops of one decoder layer of `arch` on random weights, and their inputs per token count."""

    def __init__(self, arch, device: torch.device, dtype: torch.dtype) -> None:
        w = random_stage_weights(f"profile/{arch.name}", arch, 0, 1, dtype, device)
        self.arch, self.device, self.dtype = arch, device, dtype
        self.layer = DecoderLayer.from_checkpoint(arch, 0, 0, w)
        self.table = w["model.embed_tokens.weight"]
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling, device)

    def ops(self, n: int) -> dict[str, Callable[[], object]]:
        arch, device, dtype, layer = self.arch, self.device, self.dtype, self.layer
        heads = arch.num_heads + arch.num_kv_heads
        g = torch.Generator(device=device).manual_seed(n)
        ids = torch.randint(0, arch.vocab_size, (n,), device=device, generator=g)
        x = torch.randn(n, arch.hidden_size, device=device, generator=g).to(dtype)
        attn = torch.randn(n, arch.num_heads * arch.head_dim, device=device, generator=g).to(dtype)
        stream = torch.randn(n, arch.hidden_size, device=device, generator=g).to(dtype)
        gate_up = torch.randn(n, 2 * arch.intermediate_size, device=device, generator=g).to(dtype)
        act = torch.randn(n, arch.intermediate_size, device=device, generator=g).to(dtype)
        qkv = torch.randn(n, (heads + arch.num_kv_heads) * arch.head_dim, device=device, generator=g).to(dtype)
        cos, sin = self.rotary.cos_sin(torch.arange(n, device=device), dtype)
        return {
            "emb": lambda: F.embedding(ids, self.table),
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


def _samples(fn, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """`repeats` timed samples of `fn` in seconds per call (see the module docstring)."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            return _graph_samples(fn, device, repeats)
        out = []
        for _ in range(repeats):
            best = float("inf")
            for _ in range(BURST):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out.append(best)
    return out


def _graph_samples(fn, device: torch.device, repeats: int) -> list[float]:
    """`repeats` replays of a CUDA graph of GRAPH_CALLS calls of `fn`, each timed by CUDA events."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # the allocator's warm-up outside the capture, as torch asks
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / GRAPH_CALLS)
    del graph
    return out


def profile_layer_ops(arch, device: torch.device, dtype: torch.dtype, tokens=DEFAULT_TOKENS, *,
                      repeats: int = 10, warmup: int = 2, progress=None) -> OpProfile:
    """One row per token count: ``time_stats.<op>.<stat>`` in milliseconds for every op of
    `ALL_OPS`, plus Vidur's shape columns (TP 1); with the noise seen (`OpProfile`)."""
    layer_ops = _LayerOps(arch, device, dtype)
    tokens = sorted(tokens)
    samples: dict[tuple[str, int], list[float]] = {}
    for n in tokens:
        ops = layer_ops.ops(n)
        for op in ALL_OPS:
            samples[(op, n)] = _samples(ops[op], device, repeats, warmup)
        if progress:
            layer_ms = 1e3 * sum(statistics.median(samples[(op, n)]) for op in ALL_OPS if op != "emb")
            progress(f"{arch.name}: {n} tokens: one layer's linear/elementwise ops {layer_ms:.3f} ms")
    result = OpProfile([])
    for _ in range(RETRIES):
        breaks = {(op, tokens[i]) for op in ALL_OPS
                  for i in monotone_breaks([statistics.median(samples[(op, n)]) for n in tokens])}
        if not breaks:
            break
        for op, n in sorted(breaks, key=lambda b: (b[1], b[0])):
            again = _samples(layer_ops.ops(n)[op], device, repeats, warmup)
            if statistics.median(again) < statistics.median(samples[(op, n)]):
                samples[(op, n)] = again  # a busy stretch only adds time: the lower median is closer
            result.remeasured.append(f"{op}@{n}")
        if progress:
            progress(f"{arch.name}: re-measured {len(breaks)} op point(s) that cost more than at more tokens: "
                     f"{', '.join(f'{op}@{n}' for op, n in sorted(breaks))}")
    medians = {}
    for op in ALL_OPS:
        measured = [statistics.median(samples[(op, n)]) for n in tokens]
        fixed = make_monotone(measured)
        for n, m, f in zip(tokens, measured, fixed):
            medians[(op, n)] = f
            if abs(f - m) > MONOTONE_TOL * m:  # (a wobble within the tolerance is pooled silently)
                result.adjusted.append(f"{op}@{n}")
    if result.adjusted and progress:
        progress(f"{arch.name}: still not monotone in tokens after {RETRIES} re-measurements, pooled into a "
                 f"non-decreasing median: {', '.join(result.adjusted)}")
    for n in tokens:
        row: dict = {}
        for op in ALL_OPS:
            stats = _stats_ms(samples[(op, n)])
            stats["median"] = 1e3 * medians[(op, n)]
            for stat, value in stats.items():
                row[f"time_stats.{op}.{stat}"] = value
        row.update(n_head=arch.num_heads, n_kv_head=arch.num_kv_heads, n_embd=arch.hidden_size,
                   n_expanded_embd=arch.intermediate_size, vocab_size=arch.vocab_size,
                   use_gated_mlp=arch.gated_mlp, num_tokens=n, num_tensor_parallel_workers=1)
        result.rows.append(row)
    result.spread = statistics.median(_relative_iqr(v) for v in samples.values())
    return result
