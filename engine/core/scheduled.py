"""What the engine-local scheduler hands its drivers: the batch to execute and the outcome.

Place in the data flow: `EngineScheduler.schedule` (engine/core/scheduler.py) returns a
`ScheduledBatch` (its requests as `ScheduledRequest`s, the swap plans, the message for the next
stage); the driver executes it (the torch worker, or the simulator's cost model) and passes it
back to `complete`, which returns a `Completion`. `ProtocolError` is what the scheduler raises
when a driver breaks the driving protocol; `BatchNeverFits`, when a batch received at a later
stage needs more KV than the whole pool (the driver fails those requests, not the engine).
Pure data: no torch, Ray or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraflex.errors import ParaflexError
from paraflex.engine.core.messages import DECODE, PREFILL, BatchMessage, FreeMessage, TokenMessage


class ProtocolError(ParaflexError):
    """A driver broke the driving protocol (unknown stage, duplicate request, bad message)."""


class BatchNeverFits(ProtocolError):
    """A received batch needs more KV blocks than this engine's pool holds (its engine is sized
    below the sizing requirement, docs/engine-core.md): it can never run here."""

    def __init__(self, message: str, model: str, req_ids: list[str]):
        super().__init__(message)
        self.model = model
        self.req_ids = req_ids


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a scheduled batch: what the worker computes for it."""

    req_id: str
    kind: str  # "prefill" (a prompt chunk) | "decode"
    start_pos: int  # position of the first new token
    num_tokens: int  # new tokens this step
    context_len: int  # tokens with KV here after this step (attention span)
    block_table: list[list[int]]  # [layer][logical block] -> device block; read-only, valid until complete()
    token_ids: list[int] | None = None  # first stage: input token ids of this step (None in the simulator)
    samples: bool = False  # last stage: this step produces a token
    sampling: dict | None = None  # sampling params as a dict (last stage needs them)


@dataclass
class ScheduledBatch:
    """A batch for the worker (or the simulator's cost model) to execute."""

    batch_id: str
    model: str
    stage: int
    kind: str  # "prefill" | "decode" | "mixed"
    requests: list[ScheduledRequest]
    num_layers: int
    is_first: bool
    is_last: bool
    block_bytes: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), run first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block), run second
    message: BatchMessage | None = None  # for stage + 1; None on the last stage
    src_rows: list[tuple[int, int]] | None = None  # later stages: rows [a, b) of the received tensors to keep, in order; None = all
    formed_at: float = 0.0

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.requests]

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests if r.kind == PREFILL)

    @property
    def num_decodes(self) -> int:
        return sum(1 for r in self.requests if r.kind == DECODE)

    @property
    def total_context(self) -> int:
        """Sum of decode requests' context lengths (what a decode step's attention reads)."""
        return sum(r.context_len for r in self.requests if r.kind == DECODE)

    @property
    def swap_out_bytes(self) -> int:
        return len(self.swap_out) * self.block_bytes

    @property
    def swap_in_bytes(self) -> int:
        return len(self.swap_in) * self.block_bytes


@dataclass
class Completion:
    """What `complete` reports back to the driver."""

    batch_id: str
    token_message: TokenMessage | None = None  # last stage: send to the first stage
    finished: list[str] = field(default_factory=list)  # finished here: send FreeMessage to the other stages
    aborted: list[str] = field(default_factory=list)  # aborts that waited for this batch to end

    def free_message(self, model: str) -> FreeMessage | None:
        return FreeMessage(model, list(self.finished), "finished") if self.finished else None
