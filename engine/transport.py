"""Transports: how work moves between engines (the hop between pipeline stages).

Data flow: an engine loop finishes a stage of a batch and `send`s an `Envelope` to the engine
that hosts the next stage ("batch", with hidden/residual tensors), or the last stage sends the
new tokens back to the first stage ("token", metadata only), or any engine tells the others
that a request is finished or aborted ("free"). Each engine loop polls `recv_ready()` for
envelopes addressed to it whose tensors have fully arrived.

`Transport` is the interface; `LocalTransport` implements it in one process (tests,
`paraflex generate`). The Ray transport (paraflex.engine.transport_ray) implements the same
ABC with a two-phase protocol (msgpack metadata over an actor call, then tensors over
torch.distributed). Engine loops use nothing beyond this interface.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

KINDS = ("batch", "token", "free")


@dataclass
class Envelope:
    """One message from engine `src` to engine `dst` about model `model`.

    kind: "batch" (a formed prefill/decode batch for the next stage; meta is the engine-core
    message, tensors carry hidden/residual states), "token" (last stage -> first stage: new
    tokens, metadata only), "free" (finish/abort: free the request's KV on `dst`).
    """

    src: int
    dst: int
    model: str
    kind: str
    meta: dict
    tensors: dict[str, torch.Tensor] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Envelope.kind: {self.kind!r} is not one of {KINDS}")


class Transport(ABC):
    """Moves envelopes between engines. One instance per engine (or shared in-process)."""

    @abstractmethod
    def send(self, env: Envelope) -> None:
        """Queue `env` for engine `env.dst`; never blocks on the receiver."""

    @abstractmethod
    def recv_ready(self) -> list[Envelope]:
        """Envelopes addressed to this endpoint whose tensors fully arrived; never blocks."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; later sends raise."""


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
