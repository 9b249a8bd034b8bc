"""The simulator's ONE hook into the fast path: a policy's exact replays, or step by step.

Place in the data flow: `Cluster` (simulator/core/cluster.py) holds one `FastPath` when the run
has `fast_forward` on, and calls it at two points only: `offer` after an engine's scheduler
formed a batch (`Cluster.wakeup`), `arrival` when the dispatcher sends a new request to a
replica (`Cluster.admit`). What may be replayed is the engines' policy's to say: its
`ExactReplay` (`Policy.replay`, engine/core/policies/base.py) names the closed-form replays that
follow its decisions exactly, each pinned by an equivalence test; a policy naming none (or a
batch no replay takes) runs step by step through the event loop. The replays themselves hold
no policy rule: they ask the scheduler (`QueueOrder.repeatable_decisions`) and the policy
(`class_of`).

- `pipeline_group`: the joint replay of a multi-stage replica's engines with the one-stage
  replicas on them (joint_replay.py), offered every decode batch formed on such an engine;
- `decode_cycles`: the decode fast-forward (fast_forward.py), offered every first-stage decode
  batch the joint replay did not take.
"""

from __future__ import annotations

from paraflex.engine.core.messages import DECODE
from paraflex.simulator.fastpath.fast_forward import DecodeFastForward
from paraflex.simulator.fastpath.joint_replay import JointReplay


class FastPath:
    """The fast path of one simulated cluster (see the module docstring)."""

    def __init__(self, cluster, requests):
        """`requests`: every request of the run (their arrival times bound each replay)."""
        self.decode = DecodeFastForward(cluster, requests)
        self.group = JointReplay(self.decode)
        self.replays = [eng.scheduler.policy.replay for eng in cluster.engines]  # each engine's policy's

    def offer(self, eng, sb, t: float):
        """`eng` formed `sb` at t: replay what its policy allows from there. Returns the batch
        `eng` runs now and its start, (sb, t) when nothing was replayed, or None when nothing
        runs now (a group replay took the engines over, or after replayed decode cycles
        nothing fits when their tokens are back)."""
        replay = self.replays[eng.id]
        if replay is None or sb.kind != DECODE or sb.swap_in or sb.swap_out:
            return sb, t
        if replay.pipeline_group and self.group.advance(eng, sb, t):
            return None  # replayed with the other batches on its pipeline's engines, which run on from the cut
        if replay.decode_cycles and sb.is_first:
            t_next = self.decode.advance(eng, sb, t)
            if t_next is not None:  # the batch's requests are back in the decode queue at t_next
                sb = eng.scheduler.schedule(t_next)  # (as step by step: None if nothing fits then)
                return None if sb is None else (sb, t_next)
        return sb, t

    def arrival(self, req, replica: int, route, t: float) -> bool:
        """New request `req` is dispatched at t to `replica` on `route`: True if a group replay
        waiting at t admitted it (it is added to its engine's scheduler at the replay's cut)."""
        return bool(self.group.suspended) and self.group.arrival(req, replica, route, t)

    @property
    def cycles(self) -> int:
        """Decode cycles the fast-forward replayed plus decisions the joint replay replayed."""
        return self.decode.cycles + self.group.decisions

    @property
    def until(self) -> float:
        """The last instant a replay processed (the run's last event may be one it replayed)."""
        return self.group.until
