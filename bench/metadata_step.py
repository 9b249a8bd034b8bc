"""Per-step attention metadata of a decode batch: the from-scratch build against the block
tables kept across steps, in the same run.

Place in the project: a benchmark (not a test) for engine/worker/block_tables.py. Llama-2-7B
with 32 KiB blocks has 2 tokens per block, so `AttentionMetadata.build` turns 32 layers x batch
x context/2 block ids into tensors every step; `IncrementalMetadata.build` sends the blocks
added since the last step (32 per request every other step) plus a few numbers per request.
Both run on equal requests, whose tables grow by one block per layer every
`tokens_per_block` steps as the engine's block pool grows them. The kept tables run twice: on
the CPU device (their gather and scatter run on the host too) and on the meta device (the host
work a GPU step waits for: planning, packing and dispatching the device ops, whose own work is
skipped; on a GPU they run asynchronously, plus one pinned copy). No GPU is needed.

Prints, per batch x context, the mean time per step of each (over --steps steps after
--warmup), the ratios (build / kept: > 1 means the kept tables are faster), and the machine
and its load.

Usage: python bench/metadata_step.py [--batches 1 64 128] [--contexts 512 2048] [--layers 32]
       [--tokens-per-block 2] [--steps 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.block_tables import IncrementalMetadata
from paraflex.cpu_info import machine_line

# the kept tables on the CPU device (their gathers run on the host), and on the meta device: every
# host step as on a GPU (planning, packing, dispatching the device ops) with the device's work skipped
DEVICES = ("cpu", "meta")


class Requests:
    """`batch` decode requests at `context` tokens whose layer-wise tables grow as they decode."""

    def __init__(self, batch: int, context: int, layers: int, tpb: int) -> None:
        self.layers, self.tpb, self.next_block = layers, tpb, 0
        self.reqs = [SimpleNamespace(num_tokens=1, context_len=0, block_table=[[] for _ in range(layers)])
                     for _ in range(batch)]
        self.advance(context)

    def advance(self, context: int) -> None:
        need = -(-context // self.tpb)
        for r in self.reqs:
            r.context_len = context
            for blocks in r.block_table:
                while len(blocks) < need:
                    blocks.append(self.next_block)
                    self.next_block += 1


def from_scratch(reqs: list, layers: int, tpb: int) -> AttentionMetadata:
    """What the worker does without the kept tables (engine/worker/stage_worker.py)."""
    tables = [[r.block_table[layer] for r in reqs] for layer in range(layers)]
    return AttentionMetadata.build([r.num_tokens for r in reqs], [r.context_len for r in reqs], tables, tpb)


def time_steps(batch: int, context: int, layers: int, tpb: int, steps: int, warmup: int) -> list[float]:
    """Mean seconds per step of the from-scratch build, the incremental build on the CPU device
    and the incremental build on the meta device, interleaved step by step on equal requests."""
    kept = {dev: (IncrementalMetadata(layers, tpb, dev), Requests(batch, context, layers, tpb)) for dev in DEVICES}
    scratch = Requests(batch, context, layers, tpb)
    totals = [0.0] * (1 + len(DEVICES))
    for step in range(warmup + steps):
        scratch.advance(context + step)
        start = time.perf_counter()
        from_scratch(scratch.reqs, layers, tpb)
        times = [time.perf_counter() - start]
        for ours, work in kept.values():
            work.advance(context + step)
            start = time.perf_counter()
            ours.build(work.reqs)
            times.append(time.perf_counter() - start)
        if step >= warmup:
            totals = [a + b for a, b in zip(totals, times)]
    return [t / steps for t in totals]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens-per-block", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{args.layers} layers, {args.tokens_per_block} tokens per block, decode steps; kept cpu: on the CPU device, "
          "kept host: the host work of a GPU step (meta device)")
    print(f"{'batch':>6} {'context':>8} {'build ms':>9} {'kept, cpu ms':>13} {'kept, host ms':>14} "
          f"{'build/kept cpu':>15} {'build/kept host':>16}")
    for context in args.contexts:
        for batch in args.batches:
            old, cpu, host = time_steps(batch, context, args.layers, args.tokens_per_block, args.steps, args.warmup)
            print(f"{batch:>6} {context:>8} {old * 1e3:>9.3f} {cpu * 1e3:>13.3f} {host * 1e3:>14.3f} "
                  f"{old / cpu:>14.1f}x {old / host:>15.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
