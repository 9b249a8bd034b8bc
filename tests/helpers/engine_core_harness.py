"""Test helpers for the engine core: a tiny multi-engine driver, and single-engine shortcuts.

`Cluster` follows the driving protocol of engine/core/scheduler.py exactly (like the simulator and
the torch engine loop do), with messages going through msgpack, an optional random engine
order, batches that may span a step (messages arriving while they run) and aborts; it records
every batch so tests can assert on what happened. `engine`/`run`/`deliver` drive one engine by
hand for the hand-checked scenarios.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.messages import FreeMessage, TokenMessage, pack, unpack
from paraflex.engine.core.scheduler import EngineScheduler


@dataclass
class ModelSpec:
    name: str
    engines: list[int]  # engine of each stage
    layers: list[int]  # layers of each stage
    kv_bytes: int = 256  # per token per layer


@dataclass
class Cluster:
    num_engines: int
    models: list[ModelSpec]
    blocks: int = 64
    host_blocks: int = 256
    block_bytes: int = 1024
    max_batch_size: int = 4
    policy: str = "full-batch-first"
    seed: int | None = None  # None: engines step in id order; else in a random order each step
    overlap: bool = False  # True: a batch runs across a step, so messages arrive while it runs
    sched_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.engines = [
            EngineScheduler(BlockPool(self.blocks, self.block_bytes, self.host_blocks), self.max_batch_size,
                            self.policy, engine_id=i, track_history=True, **self.sched_kwargs)
            for i in range(self.num_engines)
        ]
        self.spec = {m.name: m for m in self.models}
        for m in self.models:
            for s, (e, n) in enumerate(zip(m.engines, m.layers)):
                self.engines[e].add_stage(m.name, s, n, m.kv_bytes, len(m.engines))
        self.inbox: list[list] = [[] for _ in range(self.num_engines)]
        self.rng = random.Random(self.seed)
        self.now = 0.0
        self.started: dict[str, str] = {}  # req_id -> model
        self.tokens: dict[str, int] = {}  # req_id -> tokens delivered to the first stage
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.batches: list = []  # (engine id, ScheduledBatch) in execution order
        self.running: dict[int, object] = {}  # overlap mode: engine id -> its batch in flight

    def add(self, req_id: str, model: str, prompt_len: int, max_new: int) -> None:
        m = self.spec[model]
        self.engines[m.engines[0]].add_request(req_id, model, prompt_len, max_new, self.now)
        self.started[req_id] = model
        self.tokens[req_id] = 0

    def abort(self, req_id: str) -> None:
        if req_id in self.finished or req_id in self.aborted:
            return
        self.aborted.add(req_id)
        for e in self.spec[self.started[req_id]].engines:
            self._send(e, FreeMessage(self.started[req_id], [req_id], "aborted"))

    def _send(self, engine: int, msg) -> None:
        self.inbox[engine].append(pack(msg))

    def deliver(self) -> None:
        for e, box in enumerate(self.inbox):
            for raw in box:
                msg = unpack(raw)
                if hasattr(msg, "entries"):
                    for ent in msg.entries:
                        if ent.req_id not in self.aborted:
                            self.tokens[ent.req_id] += 1
                self.engines[e].handle(msg)
            box.clear()

    def step_engine(self, e: int) -> bool:
        sched = self.engines[e]
        if self.overlap:
            progressed = False
            if e in self.running:
                self._finish_batch(e, self.running.pop(e))
                progressed = True
            batch = sched.schedule(self.now)
            if batch is not None:
                self.batches.append((e, batch))
                self.running[e] = batch
            return progressed or batch is not None
        batch = sched.schedule(self.now)
        if batch is None:
            return False
        self.batches.append((e, batch))
        self._finish_batch(e, batch)
        return True

    def _finish_batch(self, e: int, batch) -> None:
        done = self.engines[e].complete(batch)
        m = self.spec[batch.model]
        if batch.message is not None:
            self._send(m.engines[batch.stage + 1], batch.message)
        if done.token_message is not None:
            self._send(m.engines[0], done.token_message)
            for rid in done.finished:
                self.finished.add(rid)
            fm = done.free_message(batch.model)
            if fm is not None:
                for s in range(len(m.engines) - 1):
                    self._send(m.engines[s], fm)

    def step(self) -> bool:
        """Deliver pending messages, then let every engine (in random or id order) run one batch."""
        self.deliver()
        order = list(range(self.num_engines))
        if self.seed is not None:
            self.rng.shuffle(order)
        progressed = False
        for e in order:
            progressed |= self.step_engine(e)
        self.now += 1.0
        return progressed

    def busy(self) -> bool:
        return any(self.inbox) or any(s.num_live for s in self.engines)

    def run(self, max_steps: int = 10_000, check: bool = True) -> int:
        """Step until every engine is idle; returns the steps taken."""
        for n in range(max_steps):
            progressed = self.step()
            if check:
                self.check()
            if not progressed and not any(self.inbox) and not self.running:
                return n
        raise AssertionError(f"cluster still busy after {max_steps} steps: live {[s.num_live for s in self.engines]}")

    def check(self) -> None:
        for s in self.engines:
            s.check()


# ---- single-engine helpers for hand-checked scenarios
def engine(blocks=1000, host=1000, batch=2, **kw):
    """block 1024 bytes, kv 256 bytes/token/layer -> 4 tokens per block."""
    kw.setdefault("watermark", 0.0)
    return EngineScheduler(BlockPool(blocks, 1024, host), max_batch_size=batch, **kw)


def run(sched, now=0.0, **kw):
    """One decision + completion; returns (batch, completion)."""
    b = sched.schedule(now)
    assert b is not None, "expected a runnable batch"
    return b, sched.complete(b, **kw)


def deliver(sched, done, only=None):
    """Hand (some of) a single-stage model's tokens back to its first stage."""
    tm = done.token_message
    entries = [e for e in tm.entries if only is None or e.req_id in only]
    sched.receive_tokens(TokenMessage(tm.model, tm.batch_id, entries))
