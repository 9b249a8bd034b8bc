"""A tiny multi-engine driver for the engine-core tests: message passing without tensors.

It follows the driving protocol of engine/scheduler.py exactly (like the simulator and the
torch engine loop do), with messages going through msgpack, an optional random delivery order
and random aborts, and it records every event so tests can assert on what happened.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from paraflex.engine.block_pool import BlockPool
from paraflex.engine.messages import FreeMessage, pack, unpack
from paraflex.engine.scheduler import EngineScheduler


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
        batch = sched.schedule(self.now)
        if batch is None:
            return False
        self.batches.append((e, batch))
        done = sched.complete(batch)
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
        return True

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
            if not progressed and not any(self.inbox):
                return n
        raise AssertionError(f"cluster still busy after {max_steps} steps: live {[s.num_live for s in self.engines]}")

    def check(self) -> None:
        for s in self.engines:
            s.check()
