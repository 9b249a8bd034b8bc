"""One request's life in the gateway: backend token stream -> text deltas, with bookkeeping.

Data flow: app.py admits a request (an `Admission` ticket against the outstanding limit) and iterates
`generate(...)`, which pulls `Output`s from the backend, turns tokens into text with stop
strings applied (detok.TextStream), and yields `Chunk`s. Whatever way the iteration ends
(finish, stop string, engine error, client disconnect cancelling the task), the `finally`
block aborts the request in the backend if it is still live, so every engine frees its KV,
and records the request's latencies in the Prometheus metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

import anyio

from paraflex.errors import UserError
from paraflex.serving.backend import Backend, ModelCard, Unavailable
from paraflex.gateway.detok import TextStream
from paraflex.gateway.metrics import GatewayMetrics


@dataclass
class Chunk:
    """Text produced since the previous chunk; the last chunk has finish_reason or error."""

    text: str
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int = 0  # running total of output tokens
    rejected: bool = False  # the backend refused the request up front (a 400, not a failure)
    unavailable: bool = False  # the backend could not take it now (a 503 to retry)


class Admission:
    """Counts outstanding requests against a limit (the overload 503)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.outstanding = 0

    def enter(self) -> "Ticket | None":
        """A ticket for one more request, or None when the limit is reached."""
        if self.outstanding >= self.limit:
            return None
        self.outstanding += 1
        return Ticket(self)


class Ticket:
    """One admitted request; `release` (idempotent) when its response is over."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.outstanding -= 1


class Running:
    """The requests generating now, and why new ones may not start (the server shutting down:
    `Gateway.drain`). A stream's body starts after its route returned, so a request admitted
    just before a shutdown checks `closed` when it starts."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.closed: str | None = None


async def generate(backend: Backend, metrics: GatewayMetrics, card: ModelCard, prompt_ids: list[int],
                   params, request_id: str, running: Running) -> AsyncIterator[Chunk]:
    """Run one admitted request (the caller holds its admission Ticket); its id is in
    `running.ids` meanwhile."""
    if running.closed:  # (no await between this check and joining running.ids)
        yield Chunk("", error=running.closed, unavailable=True)
        return
    arrival = time.monotonic()
    metrics.arrivals.observe(card.name)
    token_times: list[float] = []
    text = TextStream(lambda ids: card.tokenizer.decode(ids, skip_special_tokens=True), list(params.stop))
    live, finish = True, "abort"
    outputs = backend.stream(card.name, prompt_ids, params, request_id)
    running.ids.add(request_id)
    try:
        async for out in outputs:
            now = time.monotonic()
            token_times.extend([now] * len(out.token_ids))
            if out.final:
                live = False
            delta = text.feed(out.token_ids, final=out.final)
            if out.error:
                finish = "error"
                yield Chunk(delta, error=out.error, completion_tokens=len(token_times))
                return
            if text.stopped or out.finish_reason:
                finish = "stop" if text.stopped else out.finish_reason
                yield Chunk(delta, finish_reason=finish, completion_tokens=len(token_times))
                return
            if delta:
                yield Chunk(delta, completion_tokens=len(token_times))
        live, finish = False, "error"
        yield Chunk("", error="the backend ended the stream without a finish reason",
                    completion_tokens=len(token_times))
    except UserError as exc:  # refused at submit, e.g. it can never fit an engine's KV pool
        live, finish = False, "rejected"
        yield Chunk("", error=str(exc), rejected=True)
    except Unavailable as exc:  # no live replica now
        live, finish = False, "rejected"
        yield Chunk("", error=str(exc), unavailable=True)
    except Exception as exc:  # a backend bug must still end the response with an explicit error
        finish = "error"
        yield Chunk("", error=f"{type(exc).__name__}: {exc}", completion_tokens=len(token_times))
    finally:
        running.ids.discard(request_id)
        with anyio.CancelScope(shield=True):
            if live:  # stop string, client gone, or cancelled: free the KV on every engine
                await backend.abort(request_id)
            await outputs.aclose()
        if finish != "rejected":  # (refused or unavailable: never started)
            metrics.observe_request(card.name, arrival, token_times, time.monotonic(), len(prompt_ids), finish)
