"""Live re-planning in the server (`paraflex serve --replan-interval S`): measured rates in, a new
placement applied live.

Place in the data flow: the gateway tells `LiveReplanner.observe(model)` of every request it
admits (paraflex/gateway/generation.py, through the gateway's rate meter slot: this object is
that meter when re-planning is on, so `/metrics`' `paraflex:arrival_rate` shows the very rates
the planner decides on). A thread asks the planner's `ReplanController`
(planner/replan_controller.py, the one the simulator runs too) `maybe_replan(now)` every
`TICK_S` seconds; the controller itself decides when a plan is due (every `interval` seconds,
or sooner when a model's rate moves by more than `threshold`). A returned placement goes
through the backend's `change_placement` (paraflex/serving/live_placement.py, the path
`POST /v1/placement` takes: checked, one change at a time, each action logged, a failure rolled
back so the old placement serves). A refused or failed change is logged and the server goes on
with the placement it serves; the controller re-plans from the serving placement at every tick,
so a change an operator posted meanwhile is its starting point too. The planner runs in its
keep-cuts mode: it only adds, removes and moves replicas of each model's serving stage cut,
the changes the changer can make live.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from paraflex.errors import UserError
from paraflex.planner.replan_controller import ReplanController

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the controller is asked; it decides whether a plan is due
SOURCE = "re-planner"


def format_rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{m} {r:.2f}/s" for m, r in sorted(rates.items()))


class LiveReplanner:
    """One `ReplanController` over one backend that changes its placement live (see the module
    docstring). `clock` gives the time in seconds (monotonic); tests drive it by hand."""

    def __init__(self, backend, config, interval: float, threshold: float, hysteresis: float,
                 clock: Callable[[], float] = time.monotonic, report: Callable[[str], None] = log.info) -> None:
        self.backend = backend
        self.clock = clock
        self.report = report
        self.controller = ReplanController(config, backend.placement(), interval, threshold, hysteresis,
                                           start=clock(), keep_cuts=True)  # a live change cannot re-cut a model
        self.description = (f"arrivals in the last {self.controller.meter.window:g} s: the rates the live "
                            "re-planner decides on")
        self.applied: list[dict] = []  # each change's `change_placement` report
        self._lock = threading.Lock()  # the controller is not thread-safe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the rate meter
    def observe(self, model: str) -> None:
        """One request of `model` was admitted now."""
        with self._lock:
            self.controller.observe(model, self.clock())

    def rates(self) -> dict[str, float]:
        """Per model, requests/s over the controller's window ending now."""
        with self._lock:
            return self.controller.meter.rates(self.clock())

    # ------------------------------------------------------------------ re-planning
    def tick(self) -> dict | None:
        """Ask the controller; apply a new placement it returns. Returns the change's report
        (`change_placement`'s), or None when nothing changed (not due, kept, refused or failed)."""
        with self._lock:
            self.controller.placement = self.backend.placement()
            now = self.clock()
            try:
                replan = self.controller.maybe_replan(now)
            except UserError as exc:  # e.g. no placement fits these rates: say so once per interval
                self.controller.last_plan = now
                self.report(f"re-planning: {exc}; the serving placement stays")
                return None
        if replan is None:
            return None
        actions = "; ".join(p.action.describe() for p in replan.actions)
        self.report(f"re-planning ({replan.trigger}; rates {format_rates(replan.rates)}): objective "
                    f"{replan.objective_before:.4g} -> {replan.objective_after:.4g}: {actions}")
        try:
            result = self.backend.change_placement(replan.placement, SOURCE)
        except Exception as exc:  # noqa: BLE001 - refused or rolled back: the serving placement stays
            self.report(f"re-planning: the change was not applied ({type(exc).__name__}: {exc}); "
                        "the serving placement stays")
            return None
        self.report(f"re-planning: applied {len(result['actions'])} action(s) in {result['seconds']:.2f} s, "
                    f"{result['moved_bytes']} weight bytes loaded")
        self.applied.append(result)
        return result

    def start(self) -> None:
        """Tick every `TICK_S` seconds on a thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="pf-replanner", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the thread (a change under way finishes first, up to `timeout_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a planner bug must not stop serving; logged, next tick
                log.exception("re-planning: tick failed")
