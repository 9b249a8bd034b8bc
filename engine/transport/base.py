"""The transport interface: how work moves between engines (the hop between pipeline stages).

Data flow: an engine loop finishes a stage of a batch and `send`s an `Envelope` to the engine
that hosts the next stage ("batch", with hidden/residual tensors), or the last stage sends the
new tokens back to the first stage ("token", metadata only), or any engine tells the others
that a request is finished or aborted ("free"). Each engine loop polls `recv_ready()` for
envelopes addressed to it whose tensors have fully arrived.

Implementations: `LocalTransport` (paraflex.engine.transport.in_process: one process, tests,
`paraflex generate`) and the Ray transport (paraflex.engine.transport.ray: a two-phase protocol,
msgpack metadata over an actor call, then tensors over torch.distributed). Engine loops use
nothing beyond this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
