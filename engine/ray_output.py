"""The token stream from last-stage engine actors to the gateway process.

Data flow: an engine loop (inside an engine actor, paraflex.engine.ray_engine) calls
`BatchingSink.on_output(...)` for each sampled token; the sink coalesces whatever accumulates
while a push is on the wire and ships it as one msgpack payload to the `OutputRouter` actor,
one push at a time so that records stay in order.
The gateway's `RayBackend` (paraflex.serving.ray_backend) long-polls `OutputRouter.take`, which returns as
soon as anything is queued, and fans the records out to the per-request streams. Records are
`[request_id, token_ids, finish_reason, error]`; user data is msgpack, never pickled.
"""

from __future__ import annotations

import asyncio
import threading

import msgpack
import ray

PUSH_TIMEOUT_S = 30.0


@ray.remote(num_cpus=0)
class OutputRouter:
    """An async actor: engines `push`, the gateway `take`s (long poll)."""

    def __init__(self) -> None:
        self._items: list[bytes] = []
        self._event: asyncio.Event | None = None

    def _ev(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    async def push(self, payload: bytes) -> None:
        self._items.append(payload)
        self._ev().set()

    async def take(self, timeout: float) -> list[bytes]:
        """Every queued payload; waits up to `timeout` s for the first one."""
        ev = self._ev()
        if not self._items:
            try:
                await asyncio.wait_for(ev.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        items, self._items = self._items, []
        ev.clear()
        return items


def pack_records(records: list[list]) -> bytes:
    return msgpack.packb(records, use_bin_type=True)


def unpack_records(payload: bytes) -> list[list]:
    return msgpack.unpackb(payload, raw=False)


class BatchingSink:
    """The engine loop's `OutputSink` inside an actor: coalesces records and pushes them to
    the router from a sender thread, so the engine thread never waits on a Ray call."""

    def __init__(self, router) -> None:
        self.router = router
        self._records: list[list] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pf-output", daemon=True)
        self._thread.start()

    def on_output(self, request_id: str, token_ids: list[int], finish_reason: str | None,
                  error: str | None, **extra) -> None:
        with self._cv:
            self._records.append([request_id, list(token_ids), finish_reason, error])
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._records and not self._stop:
                    self._cv.wait()
                if self._stop and not self._records:
                    return
                records, self._records = self._records, []
            # Wait for each push: Ray does not keep the call order of an async actor, and a
            # request's final record must never overtake its earlier tokens. Records that pile
            # up meanwhile go out together in the next push.
            try:
                ray.get(self.router.push.remote(pack_records(records)), timeout=PUSH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - router gone: the backend fails the streams itself
                if self._stop:
                    return

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(2.0)
