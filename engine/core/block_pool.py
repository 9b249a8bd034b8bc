"""KV block accounting for one engine: one device pool of fixed-size byte blocks, one host pool.

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) asks this pool for blocks when
it forms a batch, and for swap plans when it must evict; the torch worker reads the resulting
layer-wise block tables (to run paged attention over ONE preallocated byte buffer) and executes
the swap plans (block copies device <-> host); the simulator charges time for the same plans.
Pure accounting: no torch import, so the simulator uses this very code (paper §6.2, §7).

Layout. The device pool has `capacity` blocks of `block_bytes` each, shared by every resident
(model, stage). A block holds K and V of ONE layer for `tokens_per_block` tokens of ONE model,
where ``tokens_per_block = block_bytes // kv_bytes_per_token_per_layer`` (the worker obtains the
model-specific shape with `Tensor.view`, no copy). An allocation (one request at one stage)
has a layer-wise block table: ``table[layer][logical_block] -> physical block``; every layer of
the stage holds the same number of logical blocks, ``ceil(tokens / tokens_per_block)``.

Swapping moves a whole allocation: `swap_out` returns ``[(device_block, host_block), ...]`` and
`swap_in` returns ``[(host_block, device_block), ...]`` in table order (layer-major), and the
table then names host blocks or device blocks respectively. A request's stage is therefore
either fully resident or fully swapped, never split.

A table object only ever grows by appending to its layers: when its blocks are re-placed
(`swap_out`, `swap_in`) or freed (`release`), the pool empties that object (and, on a swap,
gives the allocation a fresh table). The worker relies on this to keep block tables on the
device between steps (engine/worker/block_tables.py): a table object it has seen before holds
what it held then plus appended blocks; an emptied one is gone.

Invariants (checked by `check()`; the hypothesis tests call it after every event): no block is
owned twice; free + used = capacity on both pools; an allocation's blocks all lie in the pool it
claims to be in; every layer of an allocation has the same number of blocks.
"""

from __future__ import annotations

from collections.abc import Hashable
from itertools import chain

from paraflex.engine.core.free_list import FreeList
from paraflex.errors import ConfigError, ParaflexError


class PoolExhausted(ParaflexError):
    """The pool has fewer free blocks than asked: the caller should have checked `can_*` first."""


def tokens_per_block(block_bytes: int, kv_bytes_per_token_per_layer: int, model: str = "model") -> int:
    """How many tokens of one layer of a model fit in one block; raises ConfigError if none."""
    if kv_bytes_per_token_per_layer <= 0:
        raise ConfigError(
            f"{model}.kv_bytes_per_token_per_layer",
            f"must be > 0 (got {kv_bytes_per_token_per_layer}); check the model's kv heads and head_dim",
        )
    tpb = block_bytes // kv_bytes_per_token_per_layer
    if tpb < 1:
        raise ConfigError(
            "scheduler.block_bytes",
            f"{block_bytes} bytes is smaller than one token of one layer of {model} "
            f"({kv_bytes_per_token_per_layer} bytes); raise block_bytes to at least that",
        )
    return tpb


class Allocation:
    """The blocks of one request at one stage (owner), per layer."""

    __slots__ = ("owner", "group", "num_layers", "tokens_per_block", "table", "on_host", "blocks_per_layer")

    def __init__(self, owner: Hashable, group: Hashable, num_layers: int, tokens_per_block: int):
        self.owner = owner
        self.group = group
        self.num_layers = num_layers
        self.tokens_per_block = tokens_per_block
        self.table: list[list[int]] = [[] for _ in range(num_layers)]
        self.on_host = False
        self.blocks_per_layer = 0

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_layer * self.num_layers

    @property
    def token_capacity(self) -> int:
        return self.blocks_per_layer * self.tokens_per_block

    def blocks_for(self, num_tokens: int) -> int:
        """Total blocks (all layers) this allocation must hold to cover `num_tokens` tokens."""
        return -(-num_tokens // self.tokens_per_block) * self.num_layers


class BlockPool:
    """Device pool of `num_blocks` blocks of `block_bytes`, host pool of `host_num_blocks`.

    Owners are hashable keys chosen by the caller (the scheduler uses the request id; one
    engine hosts at most one stage of a model, so a request has one allocation per engine).
    `group` names the (model, stage) the allocation belongs to; `used_by(group)` gives the
    device blocks a resident stage holds, which the eviction policy ranks by.
    """

    def __init__(self, num_blocks: int, block_bytes: int = 32768, host_num_blocks: int = 0):
        if num_blocks < 1:
            raise ConfigError("engine.kv_blocks", f"must be >= 1 (got {num_blocks}); give the engine KV memory")
        if block_bytes < 1:
            raise ConfigError("scheduler.block_bytes", f"must be >= 1 (got {block_bytes})")
        if host_num_blocks < 0:
            raise ConfigError("cluster.host_memory_gb", f"host blocks must be >= 0 (got {host_num_blocks})")
        self.capacity = num_blocks
        self.host_capacity = host_num_blocks
        self.block_bytes = block_bytes
        # free lists are stacks, filled lazily; low ids first so allocation order is deterministic
        self._free = FreeList(num_blocks)
        self._host_free = FreeList(host_num_blocks)
        self._allocs: dict[Hashable, Allocation] = {}
        self._used_by: dict[Hashable, int] = {}
        self._host_used_by: dict[Hashable, int] = {}

    @classmethod
    def from_bytes(cls, device_bytes: int, block_bytes: int = 32768, host_bytes: int = 0) -> "BlockPool":
        """A pool sized from byte budgets (the engine's KV share, the host swap space)."""
        return cls(device_bytes // block_bytes, block_bytes, host_bytes // block_bytes)

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def host_num_free(self) -> int:
        return len(self._host_free)

    @property
    def host_num_used(self) -> int:
        return self.host_capacity - len(self._host_free)

    def used_by(self, group: Hashable) -> int:
        """Device blocks held by the allocations of one (model, stage)."""
        return self._used_by.get(group, 0)

    def host_used_by(self, group: Hashable) -> int:
        return self._host_used_by.get(group, 0)

    def tokens_per_block(self, kv_bytes_per_token_per_layer: int, model: str = "model") -> int:
        return tokens_per_block(self.block_bytes, kv_bytes_per_token_per_layer, model)

    # --- allocation --------------------------------------------------------------------
    def open(self, owner: Hashable, group: Hashable, num_layers: int, tokens_per_block: int) -> Allocation:
        """Start an empty allocation for `owner` (a request at one stage)."""
        if owner in self._allocs:
            raise ParaflexError(f"KV owner {owner!r} already has an allocation on this engine")
        alloc = Allocation(owner, group, num_layers, tokens_per_block)
        self._allocs[owner] = alloc
        return alloc

    def get(self, owner: Hashable) -> Allocation | None:
        return self._allocs.get(owner)

    def __contains__(self, owner: Hashable) -> bool:
        return owner in self._allocs

    def __len__(self) -> int:
        return len(self._allocs)

    def extra_blocks(self, alloc: Allocation, num_tokens: int) -> int:
        """Device blocks needed to make `alloc` cover `num_tokens` (all of it if on host)."""
        need = alloc.blocks_for(num_tokens)
        return need if alloc.on_host else max(0, need - alloc.num_blocks)

    def grow(self, alloc: Allocation, num_tokens: int) -> int:
        """Make a resident allocation cover `num_tokens`; returns the blocks added."""
        if alloc.on_host:
            raise ParaflexError(f"KV owner {alloc.owner!r} is swapped out; swap it in before growing it")
        per_layer = -(-num_tokens // alloc.tokens_per_block) - alloc.blocks_per_layer
        if per_layer <= 0:
            return 0
        total = per_layer * alloc.num_layers
        free = self._free
        if total > len(free):
            raise PoolExhausted(f"need {total} KV blocks for {alloc.owner!r}, {len(free)} free")
        ids = free.take(total)  # the ids per-layer takes would pop, layer after layer
        if per_layer == 1:  # (one block per layer: most growth by a token)
            for layer, bid in zip(alloc.table, ids):
                layer.append(bid)
        else:
            for i, layer in enumerate(alloc.table):
                layer.extend(ids[i * per_layer:(i + 1) * per_layer])
        alloc.blocks_per_layer += per_layer
        self._used_by[alloc.group] = self._used_by.get(alloc.group, 0) + total
        return total

    def release(self, owner: Hashable) -> int:
        """Free every block of `owner` (device or host); returns blocks freed; no-op if none."""
        alloc = self._allocs.pop(owner, None)
        if alloc is None:
            return 0
        n = alloc.num_blocks
        if alloc.on_host:
            free, used = self._host_free, self._host_used_by
        else:
            free, used = self._free, self._used_by
        free.give(chain.from_iterable(map(reversed, alloc.table)))  # layer by layer, each reversed
        for layer in alloc.table:
            layer.clear()
        alloc.blocks_per_layer = 0
        used[alloc.group] -= n
        return n

    # --- swapping ----------------------------------------------------------------------
    def swap_out(self, owner: Hashable) -> list[tuple[int, int]]:
        """Move `owner` to the host pool; returns the (device, host) block copies to execute."""
        alloc = self._allocs[owner]
        if alloc.on_host:
            raise ParaflexError(f"KV owner {owner!r} is already swapped out")
        n = alloc.num_blocks
        if n > len(self._host_free):
            raise PoolExhausted(f"host pool: need {n} blocks to swap out {owner!r}, {len(self._host_free)} free")
        plan = self._move(alloc, self._host_free, self._free)
        self._used_by[alloc.group] -= n
        self._host_used_by[alloc.group] = self._host_used_by.get(alloc.group, 0) + n
        alloc.on_host = True
        return plan

    def swap_in(self, owner: Hashable) -> list[tuple[int, int]]:
        """Move `owner` back to the device pool; returns the (host, device) block copies."""
        alloc = self._allocs[owner]
        if not alloc.on_host:
            raise ParaflexError(f"KV owner {owner!r} is not swapped out")
        n = alloc.num_blocks
        if n > len(self._free):
            raise PoolExhausted(f"need {n} KV blocks to swap in {owner!r}, {len(self._free)} free")
        plan = self._move(alloc, self._free, self._host_free)
        self._host_used_by[alloc.group] -= n
        self._used_by[alloc.group] = self._used_by.get(alloc.group, 0) + n
        alloc.on_host = False
        return plan

    @staticmethod
    def _move(alloc: Allocation, dst_free: FreeList, src_free: FreeList) -> list[tuple[int, int]]:
        plan = []
        table = []
        for layer in alloc.table:
            dst = dst_free.take(len(layer))
            plan.extend(zip(layer, dst))
            src_free.give(layer)
            layer.clear()  # the old table object is emptied, the allocation gets a fresh one
            table.append(dst)
        alloc.table = table
        return plan

    # --- invariants --------------------------------------------------------------------
    def check(self) -> None:
        """Raise ParaflexError if any accounting invariant is broken (used by tests)."""
        dev_owner: dict[int, Hashable] = {}
        host_owner: dict[int, Hashable] = {}
        used: dict[Hashable, int] = {}
        host_used: dict[Hashable, int] = {}
        for owner, alloc in self._allocs.items():
            sizes = {len(layer) for layer in alloc.table}
            if sizes != {alloc.blocks_per_layer}:
                raise ParaflexError(f"KV owner {owner!r}: layers hold {sorted(sizes)} blocks, expected {alloc.blocks_per_layer} each")
            seen, cap, tally = (host_owner, self.host_capacity, host_used) if alloc.on_host else (dev_owner, self.capacity, used)
            for layer in alloc.table:
                for b in layer:
                    if not 0 <= b < cap:
                        raise ParaflexError(f"KV owner {owner!r} holds block {b} outside its pool (size {cap})")
                    if b in seen:
                        raise ParaflexError(f"block {b} owned twice: {seen[b]!r} and {owner!r}")
                    seen[b] = owner
            tally[alloc.group] = tally.get(alloc.group, 0) + alloc.num_blocks
        for free_list, seen, cap, name in (
            (self._free, dev_owner, self.capacity, "device"),
            (self._host_free, host_owner, self.host_capacity, "host"),
        ):
            free = free_list.ids()
            if len(set(free)) != len(free):
                raise ParaflexError(f"{name} free list holds a block twice")
            both = set(free) & seen.keys()
            if both:
                raise ParaflexError(f"{name} blocks {sorted(both)[:5]} are both free and owned")
            if len(free) + len(seen) != cap:
                raise ParaflexError(f"{name} pool: free {len(free)} + used {len(seen)} != capacity {cap}")
        for mine, truth, name in ((self._used_by, used, "device"), (self._host_used_by, host_used, "host")):
            for group in set(mine) | set(truth):
                if mine.get(group, 0) != truth.get(group, 0):
                    raise ParaflexError(f"{name} usage of {group!r}: counted {mine.get(group, 0)}, actual {truth.get(group, 0)}")
