"""Build one engine (scheduler + worker + loop) from a config and a placement.

Place in the data flow: `paraflex.serving.in_process.LLMCluster` (all engines in one process) and the Ray
engine actors (one engine per process) both call `build_engine(config, placement, engine_id,
transport, sink)`. It loads only the layers of the engine's resident stages, sizes the one
shared KV pool, registers the stages with the engine-core scheduler (with the KV bytes per
token of the dtype actually used) and wires the routes of each model's replica.

Device and dtype: `device="auto"` picks CUDA when available, else CPU; `dtype="auto"` is the
model config's `dtype:` where it gives one, else bfloat16 on GPU (whatever the checkpoint's
dtype) and float32 on CPU, where a checkpoint of 2-byte weights also runs in float32 (bfloat16,
float16 and float32 can be asked for explicitly; float16 only on GPU). bfloat16 on a CPU
without native bf16 (avx512_bf16 / AMX) runs, emulated, with one warning: correct and half the
memory, but slower than float32 (docs/runtime.md, "Projection layouts").

On CUDA the engine's decode steps run as CUDA graphs captured here, after the stages load; the
KV pool is sized from the budget less the graphs' reserve (engine/kernels/cuda_graphs.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.engine_loop import EngineLoop
from paraflex.engine.worker.kv_cache import KVCache
from paraflex.engine.worker.model import Stage
from paraflex.engine.kernels import malloc_policy
from paraflex.engine.kernels.native_build import native_bf16
from paraflex.engine.core.scheduler import EngineScheduler
from paraflex.engine.worker.tokenizer import load_tokenizer
from paraflex.engine.worker.weights import load_stage_weights
from paraflex.engine.worker.stage_worker import Worker
from paraflex.errors import UserError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def choose_device(device: str | None = "auto") -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device: {device!r} asked for but no CUDA device is visible; use --device cpu")
    return dev


def choose_dtype(device: torch.device, dtype: str | torch.dtype | None = "auto") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
    chosen = _DTYPES[dtype]
    if chosen == torch.float16 and device.type == "cpu":
        raise UserError("dtype: float16 is GPU-only here; use float32 or bfloat16 on CPU")
    if chosen == torch.bfloat16 and device.type == "cpu" and not native_bf16():
        warn_emulated_bf16()
    return chosen


def model_dtype(device: torch.device, dtype: str | torch.dtype | None, model_config) -> torch.dtype:
    """The dtype a model's stages load in: `dtype`, or with "auto" the model config's `dtype:`."""
    return choose_dtype(device, model_config.dtype if dtype in (None, "auto") and model_config.dtype else dtype)


@functools.cache
def warn_emulated_bf16() -> None:
    log.warning("dtype bfloat16: this CPU has no native bf16 (avx512_bf16 / AMX); the weights take half the "
                "memory but multiply slower than float32 (use dtype: float32 for speed)")


def engine_routes(placement, engine_id: int) -> dict[str, tuple[int, int, list[int]]]:
    """model -> (replica, stage, engine ids of that replica's stages) for the engine's stages."""
    out = {}
    for ref in placement.engine(engine_id).stages:
        if ref.model in out:
            raise UserError(
                f"placement: engine {engine_id} holds two stages of {ref.model}; an engine may hold "
                "at most one stage of a model (re-run `paraflex plan`)"
            )
        out[ref.model] = (ref.replica, ref.stage, list(placement.models[ref.model].replicas[ref.replica]))
    return out


def build_engine(config, placement, engine_id: int, transport, sink, *, device="auto", dtype="auto",
                 kv_bytes: int | None = None, host_kv_bytes: int | None = None, seed: int = 0,
                 tokenizers: dict | None = None, models=None, progress=None) -> EngineLoop:
    """The `EngineLoop` of engine `engine_id`. `kv_bytes` overrides the placement's KV budget
    for this engine (default: the planned bytes; on CPU the pool's pages are committed only as
    blocks are first written, see `KVCache`);
    `host_kv_bytes` overrides cluster.host_memory_gb (swap space); `models` limits the
    resident stages to those models (default: all the placement puts here)."""
    dev = choose_device(device)
    if dev.type == "cpu":
        malloc_policy.apply()
    eng = placement.engine(engine_id)
    block_bytes = config.scheduler.block_bytes
    if kv_bytes is None:
        kv_bytes = sum(eng.kv_bytes.values())
    if host_kv_bytes is None:
        host_kv_bytes = config.cluster.host_memory_bytes
    routes_here = {m: r for m, r in engine_routes(placement, engine_id).items() if models is None or m in models}
    graph_bytes = _decode_graph_reserve(config, placement, routes_here, dev, dtype, kv_bytes, engine_id, progress)
    num_blocks, host_blocks = (kv_bytes - graph_bytes) // block_bytes, host_kv_bytes // block_bytes
    if num_blocks < 1:
        raise UserError(
            f"engine {engine_id}: KV budget {kv_bytes} bytes holds no {block_bytes}-byte block; "
            "give the engine more memory or lower scheduler.block_bytes"
        )
    kv = KVCache(num_blocks, block_bytes, host_blocks, dev)
    worker = Worker(kv)
    sched = EngineScheduler(BlockPool(num_blocks, block_bytes, host_blocks), engine_id=engine_id,
                            **config.scheduler.engine_options(dev.type == "cpu"))
    loop = EngineLoop(engine_id, sched, worker, transport, sink, {}, {}, seed)
    for model, (replica, stage, route) in routes_here.items():
        stages = placement.models[model].stages
        loaded = load_stage(config, model, stage, stages[stage], len(stages), dev, dtype, engine_id, progress,
                            (tokenizers or {}).get(model))
        loop.add_stage(model, stage, len(stages), route, *loaded)
    if graph_bytes:
        worker.capture_decode_graphs(config.scheduler.max_batch_size, graph_bytes, f"engine {engine_id}", progress)
    return loop


def load_stage(config, model: str, stage: int, layers: tuple[int, int], num_stages: int, device, dtype,
               engine_id: int, progress=None, tokenizer=None) -> tuple[Stage, object]:
    """(the worker `Stage` of `model`'s layers [a, b) with its weights loaded, the tokenizer a
    last stage decodes with, else None): what `EngineLoop.add_stage` takes. No engine state is
    touched, so a running engine loads a new stage on another thread (live re-planning) while
    it serves; `tokenizer`: one already loaded, for a last stage."""
    mc = config.model(model)
    dev = choose_device(device) if not isinstance(device, torch.device) else device
    dt = model_dtype(dev, dtype, mc)
    a, b = layers
    if progress:
        progress(f"engine {engine_id}: loading {model} stage {stage} (layers {a}-{b - 1}) on {dev} as {dt}")
    weights = load_stage_weights(mc.source, mc.arch, a, b, dt, dev, source_kind=mc.source_kind)
    if stage == num_stages - 1 and tokenizer is None:
        tokenizer = load_tokenizer(mc.source, mc.source_kind, model)
    built = Stage(mc.arch, a, b, weights, dev)
    if progress and dev.type == "cpu":
        progress(f"engine {engine_id}: {model} projection layouts (out x in): {built.projection_layouts()}")
    return built, (tokenizer if stage == num_stages - 1 else None)


def _decode_graph_reserve(config, placement, routes, dev, dtype, kv_bytes, engine_id, progress) -> int:
    """Bytes of the KV budget the engine's decode CUDA graphs get (engine/kernels/cuda_graphs.py);
    0 off CUDA, with PARAFLEX_CUDA_GRAPHS=0, or where they would take over a quarter of the budget."""
    if dev.type != "cuda":
        return 0
    from paraflex.engine.kernels import cuda_graphs

    if not cuda_graphs.enabled(dev):
        return 0
    stages = []
    for model, (_, stage, route) in routes.items():
        arch = config.model(model).arch
        a, b = placement.models[model].stages[stage]
        stages.append((arch, b - a, model_dtype(dev, dtype, config.model(model)), stage == 0, stage == len(route) - 1))
    reserve = cuda_graphs.reserve_bytes(stages, config.scheduler.max_batch_size, config.scheduler.block_bytes)
    if reserve > kv_bytes // 4:
        if progress:
            progress(f"engine {engine_id}: no CUDA graphs: their {reserve / 2**20:.0f} MiB would take over a "
                     f"quarter of the {kv_bytes / 2**20:.0f} MiB KV budget")
        return 0
    return reserve
