"""The worker: runs one scheduled batch of one resident stage on this engine's device.

Place in the data flow: the engine loop takes a `ScheduledBatch` from the engine-core
scheduler and hands it here with the hidden states received from the previous stage (None on
a first stage). The worker executes the batch's swap plan on the shared `KVCache` (device ->
host copies first, then host -> device), builds the attention metadata from the batch's
layer-wise block tables (on CUDA, the tables stay on the device between steps and only new
blocks are sent: engine/worker/block_tables.py), and runs the `Stage`. It returns the hidden
states for the next stage or, on a last stage, the logits of the requests that sample a token
this step.
"""

from __future__ import annotations

import torch

from paraflex.engine.kernels import native_attention, native_ops
from paraflex.engine.worker import block_tables
from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.kv_cache import KVCache
from paraflex.engine.worker.model import Stage
from paraflex.errors import ParaflexError


# On CPU, an unpacked stage (plain `torch.mm` weights: no compiler and no oneDNN, bfloat16 on a
# CPU without native bf16, or the layout chooser's verdict, engine/worker/model/layout_chooser.py)
# runs batches of at most 4 new tokens on ONE intra-op thread: a batch-1 decode step of SmolLM2
# took 42-47 ms on one thread and 46-57 ms on two on the 2-core VM (memory-bound matrix-vector
# products plus ~1,000 small torch ops that each pay a thread hand-off). A packed stage (the
# compiled kernels or oneDNN) runs every batch on all threads: the compiled kernels share one
# thread pool whose caller never waits for a worker that has not started, and SmolLM2 served
# over HTTP at batch 1 gave 26.5-31.6 tok/s on two threads vs 23.0-25.2 on one (two interleaved
# pairs, quiet machine; the gateway's thread shares the cores).
SERIAL_MAX_TOKENS = 4


class Worker:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.device = kv.device
        self.max_threads = torch.get_num_threads()
        self.stages: dict[str, Stage] = {}
        self._views: dict[str, torch.Tensor] = {}
        self.graphs: dict = {}  # model -> its stage's decode CUDA graphs (engine/kernels/cuda_graphs.py)
        self.metadata: dict[str, block_tables.IncrementalMetadata] = {}  # model -> its device-kept tables
        if self.device.type == "cpu":
            native_attention.load()  # build/load the kernels now, not in the first request's step
            native_ops.LIBRARY.load()

    def add_stage(self, model: str, stage: Stage) -> None:
        self.stages[model] = stage
        a = stage.arch
        self._views[model] = self.kv.model_view(a.num_kv_heads, a.head_dim, stage.dtype)
        if block_tables.enabled(self.device):
            self.metadata[model] = block_tables.IncrementalMetadata(stage.num_layers, self._views[model].shape[2],
                                                                    self.device)

    def remove_stage(self, model: str) -> None:
        """Drop `model`'s stage: its weights, KV view, tables and decode graphs (the KV blocks
        themselves belong to the shared pool)."""
        for held in (self.stages, self._views, self.metadata, self.graphs):
            held.pop(model, None)

    def capture_decode_graphs(self, max_batch_size: int, reserved: int, label: str, progress=None) -> None:
        """Capture CUDA graphs of every resident stage's decode steps (CUDA only)."""
        from paraflex.engine.kernels import cuda_graphs

        self.graphs = cuda_graphs.capture_stages(self.stages, self._views, max_batch_size, reserved, label, progress)

    def kv_bytes_per_token_per_layer(self, model: str) -> int:
        st = self.stages[model]
        return 2 * st.arch.num_kv_heads * st.arch.head_dim * torch.empty((), dtype=st.dtype).element_size()

    def run(self, batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Execute `batch` (a ScheduledBatch). Returns hidden [tokens, H] for the next stage,
        or float32 logits [sampling requests, vocab] on a last stage."""
        self.kv.swap_out(batch.swap_out)
        self.kv.swap_in(batch.swap_in)
        stage = self.stages.get(batch.model)
        if stage is None:
            raise ParaflexError(f"engine holds no stage of model {batch.model!r}")
        reqs = batch.requests
        if stage.first:
            ids = [t for r in reqs for t in r.token_ids]
            inputs = torch.tensor(ids, dtype=torch.long, device=self.device)
        else:
            if hidden is None:
                raise ParaflexError(f"batch {batch.batch_id}: hidden states from the previous stage missing")
            inputs = hidden.to(self.device)
            if batch.src_rows is not None:
                inputs = torch.cat([inputs[a:b] for a, b in batch.src_rows])
            if inputs.shape[0] != batch.num_tokens:  # the kernels would read past their buffers
                raise ParaflexError(f"batch {batch.batch_id}: {inputs.shape[0]} hidden rows received for "
                                    f"{batch.num_tokens} tokens")
        view = self._views[batch.model]
        incremental = self.metadata.get(batch.model)
        if incremental is not None:
            meta = incremental.build(reqs)
        else:
            tables = [[r.block_table[layer] for r in reqs] for layer in range(stage.num_layers)]
            meta = AttentionMetadata.build(
                [r.num_tokens for r in reqs], [r.context_len for r in reqs], tables,
                view.shape[2], self.device,
            )
        if self.device.type == "cpu" and self.max_threads > 1:
            serial = not stage.packed and batch.num_tokens <= SERIAL_MAX_TOKENS
            threads = 1 if serial else self.max_threads
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        graphs = self.graphs.get(batch.model)
        if graphs is not None and graphs.serves(meta):
            out = graphs.run(inputs, meta)
        else:
            out = stage.forward(inputs, meta, view)
        if stage.last:
            rows = [i for i, r in enumerate(reqs) if r.samples]
            if len(rows) != len(reqs):  # a batch of prompt chunks only samples nothing: rows may be []
                out = out[torch.tensor(rows, dtype=torch.long, device=out.device)]
        return out
