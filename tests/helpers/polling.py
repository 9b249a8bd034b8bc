"""Poll a condition until it holds or a time bound passes: for tests that wait on another
thread or process (a stream ending, KV being freed, an engine reported dead)."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    """True as soon as `predicate()` holds (checked every `interval` s); after `timeout`
    seconds, its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
