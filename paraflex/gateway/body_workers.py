"""Where a request body becomes what its route runs, away from the event loop.

Place in the data flow: app.py hands each POST body of the generation and token routes to
`BodyWorkers.prepare`. A body up to LARGE_BODY_BYTES is decoded on the loop (microseconds) and
prepared (request_prep.py: tokenizing, the chat template, the context check) on a worker
thread, as tokenizers release the GIL. A larger body is decoded, validated and prepared in a
small pool of worker processes: `json.loads` of an 8 MiB body holds the GIL for a second, so a
thread would stall the loop just the same (eight such bodies kept `/health` waiting seconds).
What comes back from a worker is cheap to unpickle: the error of a refused request (most large
bodies are refused: a prompt longer than the context), a prompt that fits the context, or a
rendered JSON body.

The pool starts with `paraflex serve` (`start_processes`), or else at the first large body
(the worker processes are spawned, not forked: the server holds threads and perhaps a Ray
driver) with the served models' cards (tokenizers included), pickled once when the gateway is
built: a process starts from the thread that submits to the pool, here the event loop's, and
pickling a 50k-entry tokenizer holds the GIL for ~0.3 s. The pool is shut down with the server
(server.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from paraflex.gateway.api_error import ApiError
from paraflex.gateway.request_body import decode
from paraflex.gateway.request_prep import Generation, RenderedJson, prepare
from paraflex.serving.backend import ModelCard

LARGE_BODY_BYTES = 256 << 10  # larger bodies are decoded in a worker process (smaller: < 10 ms on the loop)
WORKER_PROCESSES = max(1, min(2, (os.cpu_count() or 1) - 1))  # leave a core to the event loop

worker_cards: dict[str, ModelCard] = {}  # in a worker process: the served models (adopt_cards)


def adopt_cards(pickled_cards: bytes) -> None:
    """A worker process's initializer: the models it prepares requests for (pickled)."""
    worker_cards.clear()
    worker_cards.update(pickle.loads(pickled_cards))


def prepare_body(body: bytes, schema) -> Generation | RenderedJson:
    """In a worker process: the JSON text `body` decoded as `schema`, checked and prepared."""
    return prepare(decode(body, schema), worker_cards)


class BodyWorkers:
    """Prepares request bodies for the routes: small ones on the loop and a worker thread, large
    ones in a lazily started pool of `processes` worker processes (`executor` makes the pool;
    it is called as ProcessPoolExecutor is)."""

    def __init__(self, cards: dict[str, ModelCard], processes: int = WORKER_PROCESSES,
                 large_body_bytes: int = LARGE_BODY_BYTES, executor=ProcessPoolExecutor):
        self.cards = cards
        self.pickled_cards = pickle.dumps(cards)  # once, at start-up (see the module docstring)
        self.processes = processes
        self.large_body_bytes = large_body_bytes
        self.executor = executor
        self.pool: Executor | None = None

    def start_pool(self) -> Executor:
        if self.pool is None:
            kwargs = {"mp_context": multiprocessing.get_context("spawn")} if self.executor is ProcessPoolExecutor else {}
            self.pool = self.executor(max_workers=self.processes, initializer=adopt_cards,
                                      initargs=(self.pickled_cards,), **kwargs)
        return self.pool

    def start_processes(self) -> None:
        """Start every worker process now (`paraflex serve` does before it serves): a process
        starts from the thread that submits, and starting one from the event loop at the first
        large body, on a loaded server, held the loop up to 1.5 s."""
        pool = self.start_pool()
        for _ in range(self.processes):
            pool.submit(int)

    async def prepare(self, body: bytes, schema) -> Generation | RenderedJson:
        """The JSON text `body` as what its route runs, or an ApiError naming what is wrong."""
        if len(body) <= self.large_body_bytes:
            return await asyncio.to_thread(prepare, decode(body, schema), self.cards)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.start_pool(), prepare_body, body, schema)
        except BrokenProcessPool:  # a worker died (killed, out of memory): start afresh next time
            self.close()
            raise ApiError(503, "the process parsing large request bodies stopped; send the request again")

    def close(self) -> None:
        """Stop the worker processes (each finishes the body in hand; queued ones are dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
