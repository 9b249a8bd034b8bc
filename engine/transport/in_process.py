"""The in-process transport: every engine of one process, envelopes passed by reference.

Place in the data flow: the `Transport` (paraflex.engine.transport.base) of the in-process
runtime (`paraflex generate`, `LLMCluster`, `paraflex serve --in-process`) and of tests.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

from paraflex.engine.transport.base import Envelope, Transport


class LocalTransport(Transport):
    """In-process transport shared by all engines of one process.

    `LocalTransport()` is the shared hub; `hub.endpoint(engine_id)` returns the Transport that
    engine uses (its `recv_ready` returns only envelopes addressed to it). Tensors are passed
    by reference (`detach()`), so a sender must not modify them in place after sending.
    Thread-safe, so engine loops may run on threads.
    """

    def __init__(self) -> None:
        self._queues: dict[int, deque[Envelope]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._closed = False

    def endpoint(self, engine_id: int) -> "LocalEndpoint":
        return LocalEndpoint(self, engine_id)

    def send(self, env: Envelope) -> None:
        if self._closed:
            raise RuntimeError("LocalTransport.send: transport is closed")
        if env.tensors:
            env.tensors = {k: t.detach() for k, t in env.tensors.items()}
        with self._lock:
            self._queues[env.dst].append(env)

    def recv_for(self, engine_id: int) -> list[Envelope]:
        with self._lock:
            q = self._queues.get(engine_id)
            if not q:
                return []
            out = list(q)
            q.clear()
            return out

    def recv_ready(self) -> list[Envelope]:
        """Every pending envelope for every engine (the hub's own view, for tests)."""
        with self._lock:
            out = [env for q in self._queues.values() for env in q]
            for q in self._queues.values():
                q.clear()
            return out

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        self._closed = True


class LocalEndpoint(Transport):
    """One engine's view of a `LocalTransport` hub."""

    def __init__(self, hub: LocalTransport, engine_id: int) -> None:
        self.hub = hub
        self.engine_id = engine_id

    def send(self, env: Envelope) -> None:
        self.hub.send(env)

    def recv_ready(self) -> list[Envelope]:
        return self.hub.recv_for(self.engine_id)

    def close(self) -> None:
        self.hub.close()
