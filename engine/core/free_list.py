"""The free list of one KV block pool (engine/core/block_pool.py), filled lazily.

A pool of millions of blocks must not list every id at start-up (building one 8-GPU engine's
pool took ~1.6 s that way). `FreeList` behaves exactly like the plain stack it replaces -- a
list ``[capacity - 1, ..., 1, 0]`` popped from the end, returned ids pushed on top -- but keeps
only a high-water mark (ids >= it were never handed out, and all are free) plus a stack of the
ids returned so far. Returned ids always sit above the untouched range in the plain stack, so
popping the returned stack first, then the high-water mark upwards, yields the same ids in the
same order (tests/engine/core/test_block_pool.py pins this against the plain stack). Start-up is O(1),
taking and giving back k ids O(k).
"""

from __future__ import annotations

from collections.abc import Iterable


class FreeList:
    """Free block ids of a pool of `capacity` blocks; lowest never-used id handed out first."""

    __slots__ = ("capacity", "high", "returned")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.high = 0  # ids in [high, capacity) are free and were never handed out
        self.returned: list[int] = []  # ids given back, top of the stack last

    def __len__(self) -> int:
        return len(self.returned) + self.capacity - self.high

    def take(self, k: int) -> list[int]:
        """Pop `k` ids (the caller checked `len(self) >= k`), in pop order."""
        ret = self.returned
        m = min(k, len(ret))
        if m:
            out = ret[-m:]
            out.reverse()
            del ret[-m:]
        else:
            out = []
        rest = k - m
        if rest:
            out.extend(range(self.high, self.high + rest))
            self.high += rest
        return out

    def give(self, ids: Iterable[int]) -> None:
        """Push `ids` back, in order (the last one is popped first)."""
        self.returned.extend(ids)

    def ids(self) -> list[int]:
        """Every free id (for invariant checks: O(free blocks))."""
        return self.returned + list(range(self.high, self.capacity))
