"""Last tokens inside a joint replay (simulator/fastpath/joint_replay.py): the requests finish at their time.

The group simulation pauses after the instant at which one-stage requests produce their last
token; this event, at that instant and before any new request there (same priority as a stage
end), lets `JointReplay.finished` apply what the finishes change outside the group (records,
the dispatcher's counts) and go on with the replay or cut it.
"""

from __future__ import annotations

from paraflex.simulator.core.events.base import Event


class ReplayFinishEvent(Event):
    PRIORITY = 10
    __slots__ = ("replay", "group")

    def __init__(self, time: float, replay, group):
        super().__init__(time)
        self.replay = replay  # the cluster's JointReplay
        self.group = group  # its paused GroupSim

    def handle(self, sim) -> None:
        self.replay.finished(self.group, self.time)
