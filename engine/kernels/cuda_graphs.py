"""CUDA graphs of decode steps: one graph per (resident stage, batch-size bucket), captured at
engine start-up and replayed instead of launching a decode step's kernels one by one.

Place in the data flow: `build_engine` (engine/engine_builder.py) reserves `reserve_bytes` of
the engine's KV budget for the graphs before it sizes the pool, loads the stages, then calls
`capture_stages`. `Worker.run` hands a decode batch (one new token per request) to the stage's
`DecodeGraphs` when it `serves` it: the batch's inputs and attention metadata are copied into
static buffers (`DecodeInputs`), padded up to the bucket, and the bucket's graph replays. Prompts,
batches larger than the largest bucket and contexts longer than the captured maximum run eagerly.

Padding: a padded row has context length 0 (the attention kernel gives it zeros) and write
offset -1 (the KV-write kernel skips it), so it touches no block of the shared pool; its output
rows are dropped. Buckets follow vLLM's: 1, 2, 4, then multiples of 8 up to the engine's
`max_batch_size`. Graphs of one engine share one memory pool (they never replay concurrently).
`PARAFLEX_CUDA_GRAPHS=0` turns them off. On CPU nothing here runs except the pure parts
(`batch_buckets`, `bucket_for`, `DecodeInputs`), which the CPU tests cover.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.kernels.triton_paged_attention import MAX_SPLITS

MAX_CONTEXT = 4096  # longest context a captured graph serves (longer ones run eagerly)
RESERVE_MARGIN = 1.5  # reserve this many times the estimated activation and buffer bytes
RESERVE_FLOOR = 16 << 20  # the caching allocator hands out 2 MiB segments: small stages still take some


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("PARAFLEX_CUDA_GRAPHS", "1") != "0"


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to the first one
    that holds `max_batch_size`."""
    sizes = [1, 2, 4, *range(8, max_batch_size + 8, 8)]
    below = [b for b in sizes if b < max_batch_size]
    return below + [next(b for b in sizes if b >= max_batch_size)]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows (None: larger than every bucket)."""
    return next((b for b in buckets if b >= batch), None)


class DecodeInputs:
    """Static input buffers of one stage's decode graphs, sized for the largest bucket: the
    graphs read them at fixed addresses; `fill` copies a batch in and pads the rest."""

    def __init__(self, num_layers: int, max_batch: int, max_blocks: int, tokens_per_block: int,
                 max_context: int, hidden: tuple[int, torch.dtype] | None, device) -> None:
        """hidden: (hidden size, dtype) of a stage that takes hidden states; None for token ids."""
        i64 = {"dtype": torch.long, "device": device}
        self.tokens_per_block, self.max_context = tokens_per_block, max_context
        self.inputs = (torch.zeros(max_batch, **i64) if hidden is None else
                       torch.zeros(max_batch, hidden[0], dtype=hidden[1], device=device))
        self.positions = torch.zeros(max_batch, **i64)
        self.block_table = torch.zeros(num_layers, max_batch, max_blocks, **i64)
        self.context_lens = torch.zeros(max_batch, **i64)
        self.write_block = torch.zeros(num_layers, max_batch, **i64)
        self.write_offset = torch.full((max_batch,), -1, **i64)
        self.last_token_index = torch.arange(max_batch, device=device)

    def fill(self, inputs: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode batch in; rows past it become padding (context 0, no KV write)."""
        b, blocks = meta.num_seqs, meta.block_table.shape[2]
        self.inputs[:b].copy_(inputs)
        self.positions[:b].copy_(meta.positions)
        self.block_table[:, :b, :blocks].copy_(meta.block_table)
        self.context_lens[:b].copy_(meta.context_lens)
        self.context_lens[b:].zero_()
        self.write_block[:, :b].copy_(meta.write_block)
        self.write_offset[:b].copy_(meta.write_offset)
        self.write_offset[b:].fill_(-1)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first `bucket` rows of the buffers (views, no copy)."""
        return AttentionMetadata(
            positions=self.positions[:bucket], write_block=self.write_block[:, :bucket],
            write_offset=self.write_offset[:bucket], query_index=None, num_seqs=bucket, max_query=1,
            last_token_index=self.last_token_index[:bucket], block_table=self.block_table[:, :bucket],
            context_lens=self.context_lens[:bucket], query_lens=torch.ones(bucket, dtype=torch.long),
            tokens_per_block=self.tokens_per_block, max_context=self.max_context,
        )


class DecodeGraphs:
    """The decode graphs of one resident stage over its pool view `kv`."""

    def __init__(self, stage, kv: torch.Tensor, max_batch_size: int, max_context: int = MAX_CONTEXT) -> None:
        self.stage, self.kv = stage, kv
        self.buckets = batch_buckets(max_batch_size)
        self.max_context = max_context
        tpb = kv.shape[2]
        hidden = None if stage.first else (stage.arch.hidden_size, stage.dtype)
        self.static = DecodeInputs(stage.num_layers, self.buckets[-1], -(-max_context // tpb), tpb,
                                   max_context, hidden, kv.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self, pool) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory in `pool`)."""
        self.static.context_lens.zero_()
        self.static.write_offset.fill_(-1)  # every row padding: capture touches no KV block
        for bucket in reversed(self.buckets):
            meta = self.static.metadata(bucket)
            inputs = self.static.inputs[:bucket]
            self.stage.forward(inputs, meta, self.kv)  # warm-up: compiles kernels, sets up cuBLAS
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.stage.forward(inputs, meta, self.kv)
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize()

    def serves(self, meta: AttentionMetadata) -> bool:
        return (meta.query_index is None and meta.num_seqs <= self.buckets[-1]
                and meta.max_context <= self.max_context)

    def run(self, inputs: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The stage's output for this decode batch (a copy: the graph's buffer is reused)."""
        self.static.fill(inputs, meta)
        graph, out = self.graphs[bucket_for(meta.num_seqs, self.buckets)]
        graph.replay()
        return out[: meta.num_seqs].clone()


def reserve_bytes(stages: list[tuple], max_batch_size: int, block_bytes: int, max_context: int = MAX_CONTEXT) -> int:
    """Bytes to set aside from the KV budget for the graphs of resident stages given as
    (arch, num layers, dtype, first, last): static buffers and outputs of every stage plus the
    largest bucket's activations (one shared pool), times RESERVE_MARGIN."""
    batch = batch_buckets(max_batch_size)[-1]
    fixed, peak = 0, 0
    for arch, layers, dtype, first, last in stages:
        elem = torch.empty((), dtype=dtype).element_size()
        tpb = max(1, block_bytes // (2 * arch.num_kv_heads * arch.head_dim * elem))
        blocks = -(-max_context // tpb)
        fixed += 8 * batch * (3 + layers * (1 + blocks)) + (0 if first else batch * arch.hidden_size * elem)
        fixed += batch * (arch.vocab_size * 4 if last else arch.hidden_size * elem)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        acts = batch * elem * (4 * arch.hidden_size + 2 * (q + 2 * kv) + 3 * arch.intermediate_size)
        acts += batch * arch.num_heads * MAX_SPLITS * (arch.head_dim + 1) * 4  # split-K partials
        if last:
            acts += batch * arch.vocab_size * (elem + 4)
        peak = max(peak, acts)
    return max(RESERVE_FLOOR, math.ceil((fixed + peak) * RESERVE_MARGIN))


def capture_stages(stages: dict, views: dict, max_batch_size: int, reserved: int, label: str,
                   progress=None) -> dict[str, DecodeGraphs]:
    """Capture the decode graphs of every resident stage (model -> Stage, model -> pool view);
    reports each stage and the memory the graphs took against `reserved` on stderr (or to
    `progress`)."""
    report = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    pool = torch.cuda.graph_pool_handle()
    # a capture begins by emptying the allocator's cache (torch.cuda.graph), so measure from an
    # empty cache: from a full one, the report read -1,128 MiB on an H100 after loading two models
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    out = {}
    for model, stage in stages.items():
        start = time.perf_counter()
        graphs = DecodeGraphs(stage, views[model], max_batch_size)
        report(f"{label}: capturing {len(graphs.buckets)} CUDA graphs of {model} decode steps "
               f"(batch {graphs.buckets[0]}-{graphs.buckets[-1]}, context <= {graphs.max_context}) ...")
        graphs.capture(pool)
        out[model] = graphs
        report(f"{label}: {model} graphs captured in {time.perf_counter() - start:.1f} s")
    used = torch.cuda.memory_reserved() - before
    report(f"{label}: CUDA graphs hold {used / 2**20:.1f} MiB of the {reserved / 2**20:.1f} MiB "
           "reserved from the KV budget" + ("" if used <= reserved else " (MORE than reserved)"))
    return out
