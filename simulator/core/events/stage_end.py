"""An engine finishes executing one stage of one batch: account it, forward hidden states to
the next stage's engine or, on the last stage, emit tokens. The joint replay
(simulator/fastpath/joint_replay.py) may take over a running stage: it sets `batch` to None, and the
event then does nothing."""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class StageEndEvent(Event):
    PRIORITY = 10
    __slots__ = ("engine", "batch", "start", "decodes", "tokens")

    def __init__(self, time: float, engine, batch, start: float, decodes: int, tokens: int):
        super().__init__(time)
        self.engine = engine
        self.batch = batch
        self.start = start
        self.decodes = decodes  # decode requests in the batch (0: a prefill batch)
        self.tokens = tokens  # new tokens: rows of the hidden states sent on

    def handle(self, sim) -> None:
        if self.batch is None:  # taken over by the joint replay
            return
        sim.cluster.stage_done(self.engine, self.batch, self.start, self.time, self.decodes, self.tokens)
