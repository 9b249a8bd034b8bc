"""Which prefills pay a one-time cost in a fresh engine: each prompt length timed in order, with
the Triton kernels' compiled variants counted before and after it.

    python bench/first_prefills.py [--out DIR]        # a CUDA machine (the random-real shapes)
    python bench/first_prefills.py --small            # the same path on a CPU (no Triton there)

One in-process engine holds two random-weight Llama checkpoints of real shapes (bench/
fidelity_setup.py: llama-1b-shape, 32 tokens per KV block at the fidelity config's block bytes,
and smollm2-360m-shape, 25), runs the start-up warm-up's rounds (paraflex/serving/warm_up.py),
then one request of max_tokens 1 per length in LENGTHS (a prefill and its sampling), the same
length twice in a row, and a packed batch. Per call it prints the wall time, the KV blocks the
prompt spans and each Triton kernel that compiled a new variant, with that variant's
specialisation key: a call that is slow the first time and fast the second with a new variant
is a compile. bench/sim_fidelity.py found prefills of 0.5-1.4 s amid ones of ~15 ms on an H100
(docs/simulate.md, "Fidelity on a GPU").

Measured (NVIDIA H100 80GB HBM3, Triton 3.6, 2026-11-27), before the prefill kernel's block-table
width and metadata alignment were unspecialised (engine/kernels/triton_paged_attention.py):
llama-1b-shape's first 83 / 499 / 376 / 520 / 1,024-token prompts took 1,730 / 712 / 546 / 707 /
714 ms, each compiling a new `_prefill_kernel` variant, their repeats 10-17 ms; smollm2-360m-shape
786 / 673 / 1,214 ms at 83 / 376 / 520 tokens and 332 ms for a packed 9 x 400. After (the same
device call, the unspecialised kernels then behind a switch): no new variant after the warm-up, every first call
19-44 ms, repeats 9-28 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity_setup import REAL_SHAPES, SMALL_SHAPES, build_setup  # noqa: E402

from paraflex.config.schema import Config  # noqa: E402
from paraflex.engine.core.sampling_params import SamplingParams  # noqa: E402
from paraflex.planner import plan  # noqa: E402
from paraflex.serving.in_process import LLMCluster  # noqa: E402
from paraflex.serving.warm_up import ROUNDS  # noqa: E402

MODELS = ("llama-1b-shape", "smollm2-360m-shape")
LENGTHS = (83, 83, 499, 499, 376, 520, 700, 1024, 1024, (400,) * 9, (400,) * 9)


def kernel_variants() -> dict[str, set]:
    """Triton kernel name -> the keys of its compiled variants on every device (empty without Triton)."""
    try:
        from paraflex.engine.kernels import triton_layer_ops, triton_paged_attention
    except ImportError:
        return {}
    out = {}
    for module in (triton_paged_attention, triton_layer_ops):
        for name in dir(module):
            caches = getattr(getattr(module, name), "device_caches", None)
            if caches is not None:
                out[name] = {key for cache in caches.values() for key in cache[0]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="first-prefills", help="where the random checkpoints go")
    ap.add_argument("--small", action="store_true", help="toy shapes (a dry run on a CPU)")
    args = ap.parse_args()
    setup = build_setup("in-process", "random-small" if args.small else "random-real", os.path.abspath(args.out))
    table = SMALL_SHAPES if args.small else REAL_SHAPES
    config_dict = {**setup.config, "models": [m for m in setup.config["models"] if m["name"] in MODELS]}
    config = Config.from_dict(config_dict, source="first-prefills", base_dir=os.path.abspath(args.out))
    cluster = LLMCluster(config, plan(config))
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        for model in MODELS:
            vocab = table[model][-1]
            worker = cluster.engines[0].worker
            tpb = worker.kv.block_bytes // worker.kv_bytes_per_token_per_layer(model)
            for lengths in ROUNDS:
                cluster.generate(model, [[5 + i % (vocab - 5) for i in range(n)] for n in lengths], greedy)
            print(f"{model}: warm-up rounds done; Triton variants {sum(map(len, kernel_variants().values()))}")
            for item in LENGTHS:
                lengths = item if isinstance(item, tuple) else (item,)
                before = kernel_variants()
                start = time.perf_counter()
                cluster.generate(model, [[5 + (i * 7) % (vocab - 5) for i in range(n)] for n in lengths], greedy)
                took = time.perf_counter() - start
                new = {k: v - before.get(k, set()) for k, v in kernel_variants().items()}
                blocks = f", {-(-max(lengths) // tpb)} blocks of {tpb}"
                print(f"  {len(lengths)} x {max(lengths)} tokens{blocks}: {1000 * took:.1f} ms"
                      + "".join(f"\n    new {k}: {str(key)[:400]}" for k, keys in new.items() for key in keys),
                      flush=True)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
