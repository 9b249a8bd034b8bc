"""KV growth inside a replay: the blocks the members of replayed batches take as they decode.

Place in the data flow: the decode fast-forward (fast_forward.py) and the joint replay
(joint_decide.py) keep each member's KV on each engine as a `MemberKV` and grow it here, a
token per replayed step, into the engine's free blocks: the blocks `KVPlanner.fit` would take
(`BlockPool.extra_blocks` of a resident allocation: whole blocks per layer), with no eviction
(a step that does not fit is not replayed). The scheduler's pool itself grows at the cut, in
the same order (`BulkAdvance.replay_grows`, `advance_*_decode`).
"""

from __future__ import annotations


class MemberKV:
    """One request's KV on one engine during a replay: the tokens its blocks hold (`capacity`),
    tokens per block, layers, its context, and its allocation (or, for a prompt the replay
    formed, its request id: the allocation is made at the cut)."""

    __slots__ = ("capacity", "per_block", "layers", "context", "alloc")

    def __init__(self, alloc, context: int):
        """The KV of a block pool `Allocation` (engine/core/block_pool.py) holding `context` tokens."""
        self.capacity = alloc.blocks_per_layer * alloc.tokens_per_block
        self.per_block = alloc.tokens_per_block
        self.layers = alloc.num_layers
        self.context = context
        self.alloc = alloc

    @classmethod
    def planned(cls, rid: str, blocks: int, per_block: int, layers: int, context: int) -> "MemberKV":
        """The KV of a prompt the replay formed (`blocks` in all layers), its allocation made at
        the cut: named by its request id."""
        kv = cls.__new__(cls)
        kv.capacity, kv.per_block, kv.layers, kv.context, kv.alloc = blocks // layers * per_block, per_block, layers, context, rid
        return kv

    @property
    def blocks(self) -> int:
        """Device blocks it holds."""
        return self.capacity // self.per_block * self.layers

    def blocks_to_cover(self, target: int) -> int:
        """Blocks (all layers) it must add to hold `target` tokens, more than it holds now."""
        return (-(-target // self.per_block) - self.capacity // self.per_block) * self.layers

    def cover(self, target: int) -> None:
        """It holds `target` tokens now (whole blocks)."""
        self.capacity = -(-target // self.per_block) * self.per_block


def grow_by_one_token(engine, members: list[MemberKV]) -> bool:
    """One decode step of `members` on `engine` (its `blocks` free, its `grows` list): each
    member covers its context + 1, taking new blocks in member order (each growth recorded as
    (allocation, target tokens)); then each context is one token longer. False, and nothing
    changed, if the new blocks exceed the free ones (`schedule` would evict)."""
    need = 0
    for m in members:
        if m.context >= m.capacity:
            need += m.blocks_to_cover(m.context + 1)
    if need:
        if need > engine.blocks:
            return False
        engine.blocks -= need
        grows = engine.grows
        for m in members:
            if m.context >= m.capacity:
                target = m.context + 1
                m.cover(target)
                grows.append((m.alloc, target))
    for m in members:
        m.context += 1
    return True


def first_crossing(engines: list[list[MemberKV]]) -> int:
    """The first step k (context + k) at which some member outgrows its blocks on some engine."""
    return min(m.capacity - m.context + 1 for members in engines for m in members)


def fit_step(engines: list[list[MemberKV]], free: list[int], k: int) -> bool:
    """Step k takes each member to context + k on every engine (free blocks `free[j]` on engine
    j): reserve the new blocks on all of them, or none and say no."""
    for j, members in enumerate(engines):
        need = 0
        for m in members:
            target = m.context + k
            if target > m.capacity:
                need += m.blocks_to_cover(target)
        if need > free[j]:
            return False
    for j, members in enumerate(engines):
        for m in members:
            target = m.context + k
            if target > m.capacity:
                free[j] -= m.blocks_to_cover(target)
                m.cover(target)
    return True
