"""The end of a stage the joint replay (simulator/fastpath/joint_replay.py) already accounted for.

The replay applies a replayed stage's effects (its metrics, the scheduler state, the hop to the
next stage) in bulk; this event only does what is left at the stage's end time: a pipeline's
requests whose last token the stage produces finish (`finished`), and the engine becomes free
and decides what to run next, as after a `StageEndEvent` (same priority).
"""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class ReplayEndEvent(Event):
    PRIORITY = 10
    __slots__ = ("engine", "key", "finished")

    def __init__(self, time: float, engine, key: tuple[str, int]):
        super().__init__(time)
        self.engine = engine
        self.key = key  # (model, replica) whose stage ends
        self.finished: list[str] | tuple = ()  # a pipeline's last stage: the requests whose last token it produces

    def handle(self, sim) -> None:
        if self.key is None:  # taken over by a later replay
            return
        sim.cluster.replay_done(self.engine, self.key, self.time, self.finished)
