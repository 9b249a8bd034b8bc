"""The Ray backend's watch over its engine actors: faults, rejoins and KV stalls.

Place in the data flow: `RayBackend` (paraflex/serving/ray_backend.py) runs one `EngineMonitor`
on a thread. Every MONITOR_EVERY_S it asks Ray's GCS about each actor and polls each actor's
`status()`. An actor that dies (or whose loop failed, or that Ray restarted) goes down in the
serving frontend (`Frontend.mark_down`, paraflex/serving/frontend.py): every request on its
replicas ends with the error at once (within about a second; the issue asks for 10 s) and is
freed on the surviving engines of the replica, and the replica leaves dispatch; other models keep
serving. With `max_restarts` > 0 Ray restarts the actor; once it has reloaded, the monitor
rebuilds the process groups of its replicas (`RayEngines.rejoin`, next generation) and the
frontend lets them back into dispatch (`mark_up`). Each round's batch counts go to the
frontend's KV-stall watch (paraflex/serving/kv_stall.py). The latest status of each engine is
kept for /metrics.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import ray

from paraflex.engine.ray_engine import FAILED, READY
from paraflex.serving.frontend import Frontend
from paraflex.serving.ray_engines import RayEngines

MONITOR_EVERY_S = 0.5
REJOIN_TIMEOUT_S = 60


class EngineMonitor:
    """Liveness, restarts and batch counts of every engine actor (see the module docstring)."""

    def __init__(self, frontend: Frontend, engines: RayEngines, progress: Callable[[str], None]) -> None:
        self.frontend = frontend
        self.engines = engines
        self.progress = progress
        self._incarnation: dict[int, str] = {}  # the actor's incarnation when last seen alive
        self._restarts: dict[int, int] = {}  # Ray's restart count when last seen alive
        self._status: dict[int, dict] = {}
        self._lock = threading.Lock()  # guards _status (read by /metrics)

    def begin(self, statuses: dict[int, dict]) -> None:
        """The engines' statuses at start-up (all ready)."""
        for e, st in statuses.items():
            self._incarnation[e] = st["incarnation"]
            self._status[e] = st

    def statuses(self) -> dict[int, dict]:
        """Engine id -> its latest `status()`."""
        with self._lock:
            return dict(self._status)

    def run(self, closed: threading.Event) -> None:
        """Watch until `closed` is set (the monitor thread's body)."""
        pending: dict[int, object] = {}
        while not closed.wait(MONITOR_EVERY_S):
            for e, actor in self.engines.actors.items():
                info = _actor_info(actor)
                if info is not None and (info[0] != "ALIVE" or info[1] > self._restarts.get(e, 0)):
                    # The GCS knows at once; a status call to a restarting actor would only
                    # return once the new incarnation is up.
                    self.frontend.mark_down(e, f"engine {e} died ({info[0].lower()})")
                if e not in pending:
                    pending[e] = actor.status.remote()
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=MONITOR_EVERY_S)
            ready = set(ready)
            fresh: set[int] = set()
            for e, ref in list(pending.items()):
                if ref not in ready:
                    continue
                del pending[e]
                try:
                    st = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayActorError and friends: it died
                    self.frontend.mark_down(e, f"engine {e} died ({type(exc).__name__})")
                    continue
                self._seen(e, st)
                fresh.add(e)
            self._check_stall(time.monotonic(), fresh)

    def _check_stall(self, now: float, fresh: set[int]) -> None:
        """The KV-stall watch gets the batch counts of the live engines that answered this round
        (None for the others: stale)."""
        down = self.frontend.down_engines()
        runs = {e: st.get("runs") if e in fresh else None for e, st in self.statuses().items() if e not in down}
        self.frontend.watch_stalls(now, runs)

    def _seen(self, e: int, st: dict) -> None:
        with self._lock:
            self._status[e] = st
        restarted = st["incarnation"] != self._incarnation.get(e)
        if st["state"] == FAILED:
            self.frontend.mark_down(e, f"engine {e} failed: {st.get('error')}")
        elif restarted:
            self.frontend.mark_down(e, f"engine {e} restarted")
            if st["state"] == READY:
                self._rejoin(e, st)

    def _rejoin(self, e: int, st: dict) -> None:
        """A restarted engine has reloaded: rebuild its replicas' process groups, then let them
        back into dispatch."""
        try:
            self.engines.rejoin(e, REJOIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - stays down; the next status poll retries
            self.progress(f"paraflex: engine {e} restarted but could not rejoin: {exc}")
            return
        info = _actor_info(self.engines.actors[e])
        self._incarnation[e] = st["incarnation"]
        if info is not None:
            self._restarts[e] = info[1]
        self.frontend.mark_up(e)
        self.progress(f"paraflex: engine {e} rejoined (pid {st['pid']})")


def _actor_info(actor) -> tuple[str, int] | None:
    """(state, restart count) of an actor from Ray's GCS, or None if Ray cannot say.

    Uses `ray._private.state`: the public `ray.util.state` needs the dashboard, which the
    embedded Ray instance does not start."""
    try:
        from ray._private import state

        info = state.actors(actor_id=actor._actor_id.hex())
        return str(info["State"]), int(info.get("NumRestarts", 0))
    except Exception:  # noqa: BLE001 - an older/newer Ray: fall back on status() calls
        return None
