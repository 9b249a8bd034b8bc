"""Block tables kept on the device between steps: per step, only the blocks a request gained
since its last step cross from the host, so the host's work no longer grows with the context.

Place in the data flow: `Worker.run` (engine/worker/stage_worker.py) hands each batch's
`ScheduledRequest`s to the `IncrementalMetadata` of the batch's stage, which returns the
`AttentionMetadata` that `AttentionMetadata.build` (engine/worker/attention.py) would build from
scratch, every tensor equal (the zero padding of the block table included), from three parts:

- `TableSlots` (pure Python): gives every block table it sees a slot (a row of the stage's device
  table, per layer) and lists the entries to write this step: the columns added since the table's
  last step (decode: one block per layer every `tokens_per_block` steps), the whole row for a table
  new to it, and zeros over what a slot's previous occupant left beyond the new row;
- `DeviceTables`: the ``[layers, slots, width]`` int64 tensor on the device; applies the writes
  (one `index_copy_`) and gathers a batch's ``[layers, batch, max blocks]`` table (one `index_select`);
- `PackedUpload`: the step's small index arrays (slots, context lengths, positions, write slots,
  the table writes) packed in ONE int64 buffer, copied once from pinned memory without blocking
  (a ring of two buffers, each reused only after its previous copy ran), then viewed.

How a table is recognised between steps: by identity. The engine-core block pool
(engine/core/block_pool.py) only appends to a live allocation's table; when it re-places the
blocks (swap) or frees them, it empties that table object (a swap gives the allocation a fresh
one). So a table object seen before still starts with the blocks its slot holds, and an emptied
one marks its slot free. A slot keeps a reference to its table (ids are not reused while it
lives). As a guard against producers that rewrite a table in place, each step compares the first
and the last written block of layer 0 with what the slot holds; a mismatch rewrites the row.

Slots are freed lazily: when none is free, emptied tables and tables unseen for `STALE_STEPS`
steps give theirs back; if that frees none, the slots double. The width doubles whenever a row
needs more. `PARAFLEX_PERSISTENT_BLOCK_TABLES=0` turns all this off (the worker then builds the
metadata from scratch every step); unset, it is on for CUDA devices only (CPU steps keep the
from-scratch build, as fast there); `1` turns it on for CPU devices too (the CPU tests do).
"""

from __future__ import annotations

import ctypes
import os
from array import array
from itertools import accumulate

import torch

from paraflex.engine.worker.attention import AttentionMetadata, check_lengths

STALE_STEPS = 64  # a slot whose table sat out this many steps of its stage may be given to another


def enabled(device: torch.device) -> bool:
    """Whether the worker keeps block tables on `device` (see the module docstring)."""
    flag = os.environ.get("PARAFLEX_PERSISTENT_BLOCK_TABLES", "")
    return flag == "1" or (flag != "0" and device.type == "cuda")


class SlotEntry:
    """One table's slot and what the slot's row holds of layer 0 (for the in-place guard)."""

    __slots__ = ("table", "slot", "first", "last", "seen")

    def __init__(self, table: list[list[int]], slot: int) -> None:
        self.table, self.slot = table, slot
        self.first = self.last = -1
        self.seen = 0


class TablePlan:
    """One step's slot assignment and table writes (flat indices into the [layers, slots, width]
    table, which has `num_slots` x `width` entries per layer after this step)."""

    __slots__ = ("slots", "width_needed", "num_slots", "width", "index", "values")

    def __init__(self, slots: list[int], width_needed: int, num_slots: int, width: int,
                 index: array, values: array) -> None:
        self.slots, self.width_needed = slots, width_needed
        self.num_slots, self.width = num_slots, width
        self.index, self.values = index, values


class TableSlots:
    """Which slot of a stage's device table holds which block table, and what each step writes."""

    def __init__(self, num_layers: int, tokens_per_block: int, num_slots: int = 8, width: int = 16) -> None:
        self.num_layers, self.tokens_per_block = num_layers, tokens_per_block
        self.num_slots, self.width = num_slots, width
        self.entries: dict[int, SlotEntry] = {}  # id(table) -> its entry
        self.row_width = [0] * num_slots  # columns of a slot's row that may hold non-zero entries
        self.free = list(range(num_slots - 1, -1, -1))  # lowest slot handed out first
        self.step = 0

    def plan(self, tables: list, context_lens: list[int]) -> TablePlan:
        """Slots for this step's tables (tables[i][layer] -> blocks of request i) and the writes
        that make each slot's row equal its table's first ceil(context / tokens_per_block) blocks
        per layer, zeros after them. Raises ValueError where a table holds too few blocks."""
        self.step += 1
        tpb = self.tokens_per_block
        needs = [-(-c // tpb) for c in context_lens]
        most = max(needs)
        if most > self.width:
            self.width = max(most, 2 * self.width)
        slots, changes = [], []
        row_width, entries = self.row_width, self.entries
        for i, table in enumerate(tables):
            need, layer0 = needs[i], table[0]
            if len(layer0) < need:
                raise _too_few(i, 0, len(layer0), need, context_lens[i])
            entry = entries.get(id(table))
            if entry is None:
                entry, start = self._occupy(table), 0
            else:
                start = row_width[entry.slot]
                if start and (len(layer0) < start or layer0[0] != entry.first or layer0[start - 1] != entry.last):
                    start = 0  # rewritten in place: write the whole row again
            entry.seen = self.step
            slots.append(entry.slot)
            if start != need:
                changes.append((i, entry, start, need))
        index, values = array("q"), array("q")
        for i, entry, start, need in changes:
            self._write(entry, start, need, index, values, i, context_lens[i])
        return TablePlan(slots, most, self.num_slots, self.width, index, values)

    def _occupy(self, table: list) -> SlotEntry:
        if not self.free:
            self._sweep()
        if not self.free:
            grown = 2 * self.num_slots
            self.row_width.extend([0] * (grown - self.num_slots))
            self.free = list(range(grown - 1, self.num_slots - 1, -1))
            self.num_slots = grown
        entry = SlotEntry(table, self.free.pop())
        self.entries[id(table)] = entry
        return entry

    def _sweep(self) -> None:
        """Give back the slots of emptied tables and of tables unseen for STALE_STEPS steps."""
        oldest = self.step - STALE_STEPS
        for key, entry in list(self.entries.items()):
            if not entry.table[0] or entry.seen < oldest:
                del self.entries[key]
                self.free.append(entry.slot)

    def _write(self, entry: SlotEntry, start: int, need: int, index: array, values: array,
               request: int, context_len: int) -> None:
        """Entries of `entry`'s row: blocks [start, need) of every layer, zeros over [need, old width)."""
        layers, width, table = self.num_layers, self.width, entry.table
        per_layer = self.num_slots * width
        row = entry.slot * width
        if need - start == 1:  # decode's usual write: one block per layer
            try:
                values.extend([blocks[start] for blocks in table[:layers]])
            except IndexError:
                layer = next(n for n in range(layers) if len(table[n]) <= start)
                raise _too_few(request, layer, len(table[layer]), need, context_len) from None
            index.extend(range(row + start, layers * per_layer, per_layer))
        elif need > start:
            for layer in range(layers):
                blocks = table[layer][start:need]
                if len(blocks) != need - start:
                    raise _too_few(request, layer, len(table[layer]), need, context_len)
                base = layer * per_layer + row
                index.extend(range(base + start, base + need))
                values.extend(blocks)
        old = self.row_width[entry.slot]
        if old > need:
            for layer in range(layers):
                base = layer * per_layer + row
                index.extend(range(base + need, base + old))
            values.frombytes(bytes(8 * layers * (old - need)))
        self.row_width[entry.slot] = need
        entry.first, entry.last = table[0][0], table[0][need - 1]


def _too_few(request: int, layer: int, have: int, need: int, context_len: int) -> ValueError:
    return ValueError(f"block table of request {request} in stage layer {layer} has {have} "
                      f"blocks, {need} needed for {context_len} tokens")


class DeviceTables:
    """The [layers, slots, width] int64 block tables of one stage on its device."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.table = torch.zeros(num_layers, 0, 0, dtype=torch.long, device=device)

    def apply(self, plan: TablePlan, index: torch.Tensor, values: torch.Tensor) -> None:
        """Resize to the plan's shape (old rows kept, new entries zero), then write its entries."""
        layers, slots, width = self.table.shape
        if (slots, width) != (plan.num_slots, plan.width):
            grown = self.table.new_zeros(layers, plan.num_slots, plan.width)
            grown[:, :slots, :width].copy_(self.table)
            self.table = grown
        if index.numel():
            self.table.view(-1).index_copy_(0, index, values)

    def gather(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[layers, len(slots), width]: the first `width` columns of the rows of `slots`."""
        return self.table[:, :, :width].index_select(1, slots)


class PackedUpload:
    """One int64 host buffer per step to the device in one copy: from one of two pinned buffers
    on CUDA (each refilled only once its previous copy has run), as is elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: list[torch.Tensor | None] = [None, None]
        self.copied: list = [None, None]  # CUDA event after each pinned buffer's last copy
        self.turn = 0

    def send(self, packed: array, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(host views, device views) of the consecutive parts of `packed` of lengths `sizes`."""
        host = torch.frombuffer(packed, dtype=torch.long)
        if self.device.type != "cuda":
            views = list(host.to(self.device).split(sizes))
            return views, views
        k, n = self.turn, len(packed)
        self.turn ^= 1
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        else:
            self.copied[k] = torch.cuda.Event()
        pinned = self.pinned[k]
        if pinned is None or pinned.numel() < n:
            pinned = self.pinned[k] = torch.empty(max(n, 4096, 2 * (0 if pinned is None else pinned.numel())),
                                                  dtype=torch.long, pin_memory=True)
        ctypes.memmove(pinned.data_ptr(), packed.buffer_info()[0], 8 * n)
        dev = pinned[:n].to(self.device, non_blocking=True)
        self.copied[k].record()
        return list(host.split(sizes)), list(dev.split(sizes))


class IncrementalMetadata:
    """A stage's `AttentionMetadata` per step, with its block tables kept on the device."""

    def __init__(self, num_layers: int, tokens_per_block: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.tokens_per_block = tokens_per_block
        self.slots = TableSlots(num_layers, tokens_per_block)
        self.tables = DeviceTables(num_layers, device)
        self.upload = PackedUpload(device)

    def build(self, requests: list) -> AttentionMetadata:
        """The metadata of a batch of `ScheduledRequest`s (num_tokens, context_len, block_table)."""
        query_lens = [r.num_tokens for r in requests]
        context_lens = [r.context_len for r in requests]
        check_lengths(query_lens, context_lens)
        plan = self.slots.plan([r.block_table for r in requests], context_lens)
        tpb, width, num_seqs = self.tokens_per_block, plan.width_needed, len(requests)
        max_q = max(query_lens)
        query_start = [0, *accumulate(query_lens)]
        if max_q == 1:
            positions = [c - 1 for c in context_lens]
            write_at = [i * width + p // tpb for i, p in enumerate(positions)]
            query_index = []
        else:
            positions, write_at, query_index = array("q"), array("q"), array("q")
            for i, (q, c) in enumerate(zip(query_lens, context_lens)):
                positions.extend(range(c - q, c))
                write_at.extend([i * width + p // tpb for p in range(c - q, c)])
                query_index.extend(range(i * max_q, i * max_q + q))
        parts = (plan.slots, context_lens, query_lens, positions, [p % tpb for p in positions], write_at,
                 [s - 1 for s in query_start[1:]], query_start, query_index, plan.index, plan.values)
        packed = array("q")
        sizes = []
        for part in parts:
            packed.extend(part)
            sizes.append(len(part))
        host, dev = self.upload.send(packed, sizes)
        slots, c_lens, _, pos, write_offset, write_at, last, starts, q_index, index, values = dev
        self.tables.apply(plan, index, values)
        block_table = self.tables.gather(slots, width)
        return AttentionMetadata(
            positions=pos,
            write_block=block_table.view(block_table.shape[0], -1).index_select(1, write_at),
            write_offset=write_offset,
            query_index=None if max_q == 1 else q_index,
            num_seqs=num_seqs,
            max_query=max_q,
            last_token_index=last,
            block_table=block_table,
            context_lens=c_lens,
            query_lens=host[2],
            tokens_per_block=tpb,
            fresh=query_lens == context_lens,
            max_context=max(context_lens),
            query_start=starts,
        )
