"""The torch side of an engine's shared KV pool: ONE byte tensor, per-model views, swapping.

Place in the data flow: the engine-core `BlockPool` (pure accounting) decides which physical
block holds which (request, layer) and which blocks move to or from the host pool; this module
owns the memory those numbers index. Every model resident on the engine reads and writes the
same byte tensor through `model_view`, a `Tensor.view` reinterpretation (no copy) of shape
``[num_blocks, 2, tokens_per_block, kv_heads, head_dim]`` in the model's dtype (K at [:, 0],
V at [:, 1]); when a block is larger than a model's K+V for `tokens_per_block` tokens, the
slack at the end of the block is unused. `swap_out`/`swap_in` execute the pool's swap plans
as raw byte copies, so they work for every model at once. On CUDA the host pool is pinned and
the copies run on a side stream through pinned staging buffers: a swap-in queues behind the
work already issued and the compute stream waits for it on the device, not on the host; a
swap-out returns once its blocks are in the host pool.
"""

from __future__ import annotations

import mmap

import torch


class KVCache:
    def __init__(self, num_blocks: int, block_bytes: int, host_num_blocks: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        # Device blocks start zeroed: attention reads (and masks) slots past a request's
        # context, which must hold finite numbers. On CPU they are an anonymous memory map,
        # whose pages the OS hands out zero-filled on first write: a pool sized by the plan
        # costs memory only for the blocks requests have used.
        if self.device.type == "cpu":
            backing = mmap.mmap(-1, max(1, num_blocks * block_bytes))  # kept alive by the tensor
            self.blocks = torch.frombuffer(backing, dtype=torch.uint8)[: num_blocks * block_bytes].view(
                num_blocks, block_bytes)
        else:
            self.blocks = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=self.device)
        pin = self.device.type == "cuda"
        # Host blocks are only read after a swap-out wrote them, so they start uninitialised:
        # untouched pages cost no memory.
        self.host_blocks = torch.empty(host_num_blocks, block_bytes, dtype=torch.uint8, pin_memory=pin)
        self._views: dict[tuple, torch.Tensor] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if pin else None

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def model_view(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_blocks, 2, tokens_per_block, kv_heads, head_dim] view of the pool in `dtype`."""
        key = (num_kv_heads, head_dim, dtype)
        view = self._views.get(key)
        if view is None:
            elem = torch.empty((), dtype=dtype).element_size()
            per_token = 2 * num_kv_heads * head_dim * elem
            tpb = self.block_bytes // per_token
            if tpb < 1 or self.block_bytes % elem:
                raise ValueError(
                    f"block_bytes {self.block_bytes} cannot hold one token of K+V "
                    f"({per_token} bytes); raise scheduler.block_bytes"
                )
            used = self.blocks[:, : 2 * tpb * num_kv_heads * head_dim * elem]
            view = used.view(dtype).view(self.num_blocks, 2, tpb, num_kv_heads, head_dim)
            self._views[key] = view
        return view

    def swap_out(self, plan: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: plan = [(device_block, host_block), ...]."""
        if not plan:
            return
        src = torch.tensor([p[0] for p in plan], device=self.device)
        dst = torch.tensor([p[1] for p in plan])
        if self._copy_stream is None:
            self.host_blocks[dst] = self.blocks[src]
            return
        side = self._copy_stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' last writes first
        staging = torch.empty(len(plan), self.block_bytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(side):
            staging.copy_(self.blocks.index_select(0, src), non_blocking=True)
        side.synchronize()
        self.host_blocks[dst] = staging

    def swap_in(self, plan: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: plan = [(host_block, device_block), ...]."""
        if not plan:
            return
        src = torch.tensor([p[0] for p in plan])
        dst = torch.tensor([p[1] for p in plan], device=self.device)
        if self._copy_stream is None:
            self.blocks[dst] = self.host_blocks[src]
            return
        staging = torch.empty(len(plan), self.block_bytes, dtype=torch.uint8, pin_memory=True)
        torch.index_select(self.host_blocks, 0, src, out=staging)
        side, compute = self._copy_stream, torch.cuda.current_stream(self.device)
        side.wait_stream(compute)  # earlier work may still read the blocks being overwritten
        with torch.cuda.stream(side):
            self.blocks.index_copy_(0, dst, staging.to(self.device, non_blocking=True))
        compute.wait_stream(side)
