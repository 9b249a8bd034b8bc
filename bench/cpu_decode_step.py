"""CPU decode step of SmolLM2-135M (float32 or bfloat16): the engine's fast paths against its
plain-torch peers, in the same run.

Place in the project: a benchmark (not a test) for the CPU engine's compiled/packed paths:

1. attention: the compiled decode kernel (csrc/paged_decode_attention.c, reading KV blocks in
   place) vs the torch path (one row `index_select` of the context per layer + grouped matmuls),
   all 30 layers of a decode batch over scattered blocks;
2. projections: the layouts the engine chose per shape (engine/worker/model/layout_chooser.py)
   vs each layout alone: the compiled panel kernel (csrc/linear_f32.c, float32 only), oneDNN's
   packed kernel (bfloat16: AMX where present) and `torch.mm` over [in, out] weights, all
   projections of the 30 layers plus the LM head, with each layer's own weights (cold caches,
   as in a step);
3. layer ops: the compiled elementwise ops (csrc/decoder_layer_ops.c: residual add + RMSNorm
   twice, the rotation of queries and keys, SiLU(gate) * up) vs their torch formulas, all 30 layers;
4. the whole `Stage.forward` of a decode step with all fast paths vs with none ("step"), and vs
   the same layouts with the compiled attention and layer ops off ("step, ops off": what those
   two kernels save in a step);
5. a --prompt-token prefill of one request (its first token: TTFT's forward) with the compiled
   layer ops vs without (same layouts and attention: the compiled prompt kernel in float32,
   torch's in bfloat16).

bfloat16 (--dtype bfloat16): the same rows, the compiled attention and layer ops in their
bfloat16 variants (float32 math, bfloat16 in and out). Prints, per batch size, the least wall time of --repeat
runs of each contender (interleaved), the ratio (peer / ours: > 1 means ours is faster), the
layouts chosen, and the machine: its CPU flags, torch's vector capability, whether oneDNN has
native bf16, the OpenMP wait policy and the load. `paraflex serve` runs its engines with
OMP_WAIT_POLICY=PASSIVE (engine/kernels/omp_policy.py): set it here to measure as it serves.

Usage: python bench/cpu_decode_step.py [--batches 1 8 32] [--context 192] [--threads 2] [--repeat 5]
                                       [--dtype float32|bfloat16] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from unittest import mock

import torch

from paraflex.models.arch_files import arch_from_gguf, smollm2_gguf_path
from paraflex.engine.kernels import native_attention, native_ops
from paraflex.engine.kernels.native_build import capability_line
from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.kv_cache import KVCache
from paraflex.engine.worker.model import Stage
from paraflex.engine.worker.model import layer_ops
from paraflex.engine.worker.model import linear as linear_module
from paraflex.engine.worker.weights import load_stage_weights


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def least_pair(ours, peer, repeat: int, clock=time.perf_counter) -> tuple[float, float]:
    """Least time of each by `clock`, the two run alternately (so load changes hit both)."""
    ours(), peer()
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, fn in enumerate((ours, peer)):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best[0], best[1]


def torch_attention(fn):
    """`fn` with the compiled attention kernel switched off (the torch path)."""
    def run():
        with mock.patch.object(native_attention, "usable", lambda *_: False):
            fn()
    return run


def torch_ops(fn):
    """`fn` with the compiled layer ops switched off (their torch formulas)."""
    def run():
        with mock.patch.object(native_ops, "applies", lambda *_: False):
            fn()
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=192, help="tokens of context per request (default 192)")
    ap.add_argument("--prompt", type=int, default=128, help="tokens of the prefill compared (default 128; 0: none)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="cpu: the process's CPU time, for --threads 1 on a machine others load (time the OS "
                         "gives other processes is not counted; with more threads it sums them)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (the CPU time of several threads is their sum)")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if any(lib.load() is None for lib in (native_attention.LIBRARY, native_ops.LIBRARY, linear_module.LIBRARY)):
        print("the compiled kernels cannot be built here (see the warning above); nothing to compare")
        return 1
    print(f"machine: {platform.machine()} {platform.processor() or ''} torch={torch.__version__} threads={args.threads} "
          f"{capability_line()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
          f"loadavg={os.getloadavg()[0]:.1f}")
    path = smollm2_gguf_path()
    arch = arch_from_gguf(path, "smollm2-135m")
    weights = load_stage_weights(path, arch, 0, arch.num_layers, dtype, "cpu", "gguf")
    fast = Stage(arch, 0, arch.num_layers, weights)  # the chooser's layouts
    print(f"layouts chosen (out x in): {fast.projection_layouts()}")
    candidates = linear_module.candidate_layouts(torch.device("cpu"), dtype)
    alone = {}  # each layout on its own
    for layout in candidates:
        with mock.patch.object(linear_module, "candidate_layouts", lambda *_, name=layout: [name]):
            alone[layout] = Stage(arch, 0, arch.num_layers, weights)
    plain = alone["mm"]
    layers, ctx = arch.num_layers, args.context
    tpb = 32768 // (2 * arch.num_kv_heads * arch.head_dim * dtype.itemsize)  # as the pool view holds them
    per = -(-ctx // tpb)
    num_blocks = layers * max(max(args.batches) * per, -(-args.prompt // tpb)) + 1
    kv_cache = KVCache(num_blocks, 32768)
    kv = kv_cache.model_view(arch.num_kv_heads, arch.head_dim, dtype)
    torch.nn.init.normal_(kv)
    assert kv.shape[2] == tpb
    print(f"model: SmolLM2-135M {args.dtype}, {layers} layers, context {ctx} per request, {tpb} tokens per block; "
          f"least {args.clock} time of {args.repeat} runs, contenders interleaved\n")
    print(f"{'batch':>5} {'what':<15} {'ours ms':>9} {'peer ms':>9} {'peer/ours':>10}")
    for b in args.batches:
        perm = torch.randperm(num_blocks - 1)[: layers * b * per] + 1  # scattered blocks, as in a used pool
        tables = perm.view(layers, b, per).tolist()
        q = torch.randn(b, arch.num_heads, arch.head_dim).to(dtype)
        k = torch.randn(b, arch.num_kv_heads, arch.head_dim).to(dtype)
        v = torch.randn(b, arch.num_kv_heads, arch.head_dim).to(dtype)
        ids = torch.randint(0, arch.vocab_size, (b,))

        def meta():
            return AttentionMetadata.build([1] * b, [ctx] * b, tables, tpb)

        def attention():
            m = meta()
            for layer in range(layers):
                paged_attention(q, k, v, kv, layer, m, arch.head_dim ** -0.5)

        def projections(stage):
            x = torch.randn(b, arch.hidden_size).to(dtype)
            act = torch.randn(b, arch.intermediate_size).to(dtype)
            attn = torch.randn(b, arch.num_heads * arch.head_dim).to(dtype)
            for layer in stage.layers:
                layer.qkv(x), layer.o_proj(attn), layer.gate_up(x), layer.down(act)
            stage.lm_head(x)

        def glue():
            stream, x = torch.randn(b, arch.hidden_size).to(dtype), torch.randn(b, arch.hidden_size).to(dtype)
            qkv = torch.randn(b, (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim).to(dtype)
            gate_up = torch.randn(b, 2 * arch.intermediate_size).to(dtype)
            cos, sin = fast.rotary.cos_sin(torch.full((b,), ctx - 1), dtype)
            with torch.inference_mode():
                for layer in fast.layers:
                    layer_ops.add_rms_norm(stream, x, layer.input_norm, layer.eps)
                    layer_ops.rotate_queries_keys(qkv, arch.num_heads + arch.num_kv_heads, arch.head_dim, cos, sin)
                    layer_ops.add_rms_norm(stream, x, layer.post_norm, layer.eps)
                    layer_ops.silu_mul(gate_up)

        def step(stage):
            with torch.inference_mode():
                stage.forward(ids, meta(), kv)

        def pair(ours, peer):
            return least_pair(ours, peer, args.repeat, CLOCKS[args.clock])

        rows = [("attention", *pair(attention, torch_attention(attention)))]
        rows += [(f"proj vs {layout}", *pair(lambda: projections(fast), lambda s=stage: projections(s)))
                 for layout, stage in alone.items()]
        rows.append(("layer ops", *pair(glue, torch_ops(glue))))
        rows.append(("step", *pair(lambda: step(fast), torch_ops(torch_attention(lambda: step(plain))))))
        rows.append(("step, ops off", *pair(lambda: step(fast), torch_ops(torch_attention(lambda: step(fast))))))
        for what, t_ours, t_peer in rows:
            print(f"{b:>5} {what:<15} {t_ours * 1e3:9.1f} {t_peer * 1e3:9.1f} {t_peer / t_ours:9.2f}x")
    if args.prompt:
        prompt_ids = torch.randint(0, arch.vocab_size, (args.prompt,))
        prompt_tables = [[list(range(1 + layer * -(-args.prompt // tpb), 1 + (layer + 1) * -(-args.prompt // tpb)))]
                         for layer in range(layers)]

        def prefill():
            with torch.inference_mode():
                fast.forward(prompt_ids, AttentionMetadata.build([args.prompt], [args.prompt], prompt_tables, tpb), kv)

        t_ours, t_peer = least_pair(prefill, torch_ops(prefill), args.repeat, CLOCKS[args.clock])
        print(f"{1:>5} {f'prefill {args.prompt}':<15} {t_ours * 1e3:9.1f} {t_peer * 1e3:9.1f} {t_peer / t_ours:9.2f}x")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    print("attention peer: the torch path (row index_select + grouped matmuls); projection peers: each layout alone "
          "(panels: the compiled kernel, onednn: oneDNN's packed kernel, mm: torch.mm over [in, out] weights); layer "
          "ops peer: their torch formulas; step peer: all of them off (the plain-torch engine); 'step, ops off' peer: "
          "the chosen layouts with the compiled attention and layer ops off; prefill peer: the layer ops off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
