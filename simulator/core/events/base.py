"""The base class of every simulator event: a time, a tie-break priority and a handler.

One event type per module in this package (Vidur style); `EventLoop` orders them and calls
`handle(sim)`, which mutates the simulated cluster and schedules follow-up events.
"""

from __future__ import annotations

from typing import Any


class Event:
    """Something that happens at `time`. Lower `PRIORITY` runs first among equal times."""

    PRIORITY = 50
    __slots__ = ("time",)

    def __init__(self, time: float):
        self.time = time

    def handle(self, sim: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
