"""Changing the placement of a serving cluster live: the actions applied in a safe order.

Place in the data flow: `POST /v1/placement` (paraflex/gateway/placement_routes.py) and, once it
is plugged in, the re-planning controller hand a new `Placement` to the backend's
`change_placement`, which calls `PlacementChanger.apply` (the one hook: a `Placement` in, the
change applied or refused). `check_placement` validates it as `--placement` is validated
(`Placement.check_models`, `planner.validate.require_valid_layout`), plus the memory rule (5).
The change is `planner.placement_diff.diff_placements(serving, new)`: replica adds and removes.
Each goes through a `StageControl` (in process: paraflex/serving/in_process_stages.py; Ray:
paraflex/serving/ray_stages.py) and the serving frontend (paraflex/serving/frontend.py):

- add: every stage of the replica loads on its engine while the engine serves its other stages
  (its KV comes from the engine's shared pool), the replica's process group is built, and only
  then does the dispatcher see the replica (`Frontend.add_replica`);
- remove: the replica leaves dispatch (`retire_replica`), drains for up to `drain_timeout_s`,
  and what is still running then restarts by recompute on the model's other replicas
  (`move_off`: the tokens already streamed are kept, the stream pauses and goes on); then it
  leaves the serving placement, its engines drop its stages (weights, KV, leftover requests) and
  only then its process group (a stage still stepping would send into a group gone).

Order: first the adds whose engines hold no stage of their model (make before break), then the
removes, then the adds that needed a removed replica's engine; a change that would leave a
model with no replica in between is refused. A failed action undoes itself and every action
done before it (an added replica is removed again, a removed one reloaded), so the old
placement serves; the error says so. One change at a time. Each action logs one line with its
duration and counts in `counters` (the backends put them in /metrics).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.planner.placement_diff import ReplicaAction, diff_placements, moved_bytes
from paraflex.planner.validate import require_valid_layout, violations
from paraflex.serving.admission import kv_limits_by_model

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # a removed replica's requests may finish before they are moved
POLL_S = 0.02


class PlacementRejected(UserError):
    """A placement change refused or undone; `status` is its HTTP status: 400 (not a placement
    for this config), 409 (cannot fit, cannot be applied live, another change under way),
    503 (an engine it needs is dead), 500 (an action failed; rolled back)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class StageControl(Protocol):
    """What the changer needs of a backend's engines (the calls block until done)."""

    def cannot_host(self, engine: int) -> str | None:
        """Why `engine` cannot take a stage now, or None."""

    def load_stage(self, engine: int, model: str, stage: int, layers: tuple[int, int], num_stages: int,
                   route: list[int]) -> None:
        """Load the stage's weights and make it resident, serving on the replica `route`."""

    def unload_stage(self, engine: int, model: str) -> None:
        """Drop `model`'s stage from `engine` (weights, KV, leftovers of its requests)."""

    def join_replica(self, model: str, engines: list[int]) -> None:
        """Connect the replica's engines (a process group) once its stages are loaded."""

    def leave_replica(self, model: str, engines: list[int]) -> None:
        """Disconnect a removed replica's engines."""

    def kv_token_limits(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per engine, its scheduler's `kv_token_limits()` (admission's input)."""


def check_placement(config, placement: Placement, source: str = "placement") -> None:
    """Raise `PlacementRejected` unless `placement` could serve `config`: 400 when it is not a
    placement for this config (as `--placement` checks it), 409 when its stages cannot fit (5)."""
    try:
        placement.check_models(config, source=source)
        require_valid_layout(placement, config, source=source)
    except UserError as exc:
        raise PlacementRejected(400, str(exc)) from None
    memory = [p for p in violations(placement, config) if p.startswith("(5):")]
    if memory:
        raise PlacementRejected(409, f"{source}: cannot fit: {'; '.join(memory[:3])}; re-plan with "
                                     f"`paraflex plan {config.source}`")


@dataclass
class ChangeCounters:
    """Actions by (op, outcome: "done", "failed", "rolled_back") and weight bytes loaded."""

    actions: dict[tuple[str, str], int] = field(default_factory=dict)
    moved_bytes: int = 0  # every replica's weights loaded, a rollback's reload too

    def count(self, action: ReplicaAction, outcome: str) -> None:
        key = (action.op, outcome)
        self.actions[key] = self.actions.get(key, 0) + 1


def _undo(action: ReplicaAction) -> ReplicaAction:
    return ReplicaAction("remove" if action.op == "add" else "add", action.model, action.replica, action.stages,
                         action.engines, action.weight_bytes)


class PlacementChanger:
    """Applies new placements to one serving frontend over one `StageControl`."""

    def __init__(self, config, frontend, stages: StageControl, report: Callable[[str], None] = log.info,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.config = config
        self.frontend = frontend
        self.stages = stages
        self.report = report
        self.drain_timeout_s = drain_timeout_s
        self.counters = ChangeCounters()
        self._busy = threading.Lock()

    def placement(self) -> Placement:
        """The serving placement (between two states while a change is under way)."""
        with self.frontend.lock:
            return self.frontend.placement

    def apply(self, new: Placement, source: str = "placement") -> dict:
        """Make `new` the serving placement, live (see the module docstring). Returns what was
        done: {"actions": [action dict + "seconds"], "moved_bytes", "seconds"}; raises
        `PlacementRejected` with nothing changed."""
        check_placement(self.config, new, source)
        if not self._busy.acquire(blocking=False):
            raise PlacementRejected(409, "another placement change is under way; retry when it has ended")
        try:
            order = self._order(new)
            t0 = time.monotonic()
            done: list[tuple[ReplicaAction, float]] = []
            for action in order:
                try:
                    done.append((action, self._run(action)))
                    self.counters.count(action, "done")
                except Exception as exc:  # noqa: BLE001 - undone, then reported as one error
                    self.counters.count(action, "failed")
                    raise self._rolled_back(action, exc, [a for a, _ in done]) from exc
            self.frontend.install(new)
            return {"actions": [{**a.to_dict(), "seconds": round(s, 3)} for a, s in done],
                    "moved_bytes": moved_bytes([a for a, _ in done]), "seconds": round(time.monotonic() - t0, 3)}
        finally:
            self._busy.release()

    # ------------------------------------------------------------------ planning the order
    def _order(self, new: Placement) -> list[ReplicaAction]:
        current = self.placement()
        for model, m in new.models.items():
            if [tuple(s) for s in m.stages] != [tuple(s) for s in current.models[model].stages]:
                raise PlacementRejected(409, f"model {model}: the change cuts it into other stages "
                                             f"({m.stages} instead of {current.models[model].stages}); a live change "
                                             "keeps each model's cut: restart the server with this placement")
        actions = diff_placements(current, new, {mc.name: mc.arch for mc in self.config.models})
        down = self.frontend.down_engines()
        for action in actions:
            for e in action.engines:
                if e in down:
                    raise PlacementRejected(503, f"engine {e} is dead ({down[e]}); the change would "
                                                 f"{action.describe()}; retry once it is back")
                why = self.stages.cannot_host(e) if action.op == "add" else None
                if why:
                    raise PlacementRejected(409, f"cannot {action.describe()}: {why}")
        removes = [a for a in actions if a.op == "remove"]
        held = {(m, e) for m, mp in current.models.items() for r in mp.replicas for e in r}
        later = [a for a in actions if a.op == "add" and any((a.model, e) in held for e in a.engines)]
        first = [a for a in actions if a.op == "add" and a not in later]
        for model in {a.model for a in later}:
            kept = len(current.models[model].replicas) - sum(a.model == model for a in removes)
            if kept + sum(a.model == model for a in first) == 0:
                raise PlacementRejected(409, f"model {model}: every replica moves onto engines its old replicas "
                                             "hold, so it would have none while they swap (an engine holds one "
                                             "stage of a model); apply it in two steps: first a placement that "
                                             "adds the new replicas elsewhere, then this one")
        return first + removes + later

    # ------------------------------------------------------------------ running actions
    def _run(self, action: ReplicaAction, what: str = "done") -> float:
        t0 = time.monotonic()
        if action.op == "add":
            self._add(action)
        else:
            self._remove(action)
        seconds = time.monotonic() - t0
        self.report(f"placement: {action.describe()}: {what} in {seconds:.2f} s")
        return seconds

    def _add(self, action: ReplicaAction) -> None:
        engines = list(action.engines)
        loaded = []
        try:
            for k, (layers, e) in enumerate(zip(action.stages, engines)):
                self.stages.load_stage(e, action.model, k, tuple(layers), len(action.stages), engines)
                loaded.append(e)
            self.stages.join_replica(action.model, engines)
        except BaseException:
            for e in loaded:
                self._quietly(self.stages.unload_stage, e, action.model)
            raise
        self.counters.moved_bytes += action.weight_bytes
        self.frontend.add_replica(action.model, engines)
        self.frontend.kv_limits = kv_limits_by_model(self.stages.kv_token_limits())

    def _remove(self, action: ReplicaAction) -> None:
        model, engines = action.model, list(action.engines)
        self.frontend.retire_replica(model, engines)
        deadline = time.monotonic() + self.drain_timeout_s
        while self.frontend.requests_on(model, engines) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.frontend.move_off(model, engines, f"replica of {model} on engines {engines} removed by a placement "
                                               "change, and no other replica of it could take the request")
        self.frontend.drop_replica(model, engines)
        # the stages first (none of their batches runs after), then their group: an engine still
        # stepping a leftover batch of the model would otherwise send into a group that is gone
        down = self.frontend.down_engines()
        for e in engines:
            if e not in down:
                self.stages.unload_stage(e, model)
        self.stages.leave_replica(model, engines)
        self.frontend.kv_limits = kv_limits_by_model(self.stages.kv_token_limits())

    def _rolled_back(self, failed: ReplicaAction, exc: BaseException, done: list[ReplicaAction]) -> PlacementRejected:
        """Undo `done` (newest first) after `failed` raised `exc`: the error to raise."""
        self.report(f"placement: {failed.describe()}: failed: {type(exc).__name__}: {exc}; rolling back "
                    f"{len(done)} action(s)")
        problems = []
        for action in reversed(done):
            undo = _undo(action)
            try:
                self._run(undo, "rolled back")
                self.counters.count(action, "rolled_back")
            except Exception as undo_exc:  # noqa: BLE001 - reported, the rest still undone
                problems.append(f"{undo.describe()}: {type(undo_exc).__name__}: {undo_exc}")
        down = self.frontend.down_engines()
        status = 503 if any(e in down for e in failed.engines) else 500
        message = f"could not {failed.describe()}: {type(exc).__name__}: {exc}"
        if problems:
            return PlacementRejected(500, f"{message}; the rollback failed too ({'; '.join(problems)}): the "
                                          "server serves the placement GET /v1/placement shows")
        return PlacementRejected(status, f"{message}; rolled back {len(done)} action(s): the old placement serves")

    def _quietly(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a cleanup after a failure: log, go on
            log.exception("placement: cleanup %s%s failed", getattr(fn, "__name__", fn), args)
