"""The re-planning controller: per-model arrival rates in, a new placement and its actions out.

Place in the data flow: the simulator (simulator/core/live_placement.py) and the server's
frontend both own one `ReplanController`; they call `observe(model, t)` on every arrival and
`maybe_replan(now)` from time to time, then apply the `Replan`'s actions (loads with their
costs, drains). Pure: no clock is read here, every method is given the time, so the simulator
and the server run the very same decisions.

`RateMeter`: a sliding window of `window` seconds over arrivals; a model's rate is its arrivals
in (now - window, now] / window. `ReplanController.maybe_replan(now)` re-plans when
`interval` seconds passed since the last plan, or sooner when some model's measured rate moved
by more than `threshold` (relative to its rate at the last plan, a floor of 10% of the mean rate
keeping idle models from triggering on one request); it waits for one full window after start
and after every plan so the meter describes the traffic since. The incremental planner
(planner/incremental.py) decides whether anything moves: None when the placement stays;
`keep_cuts` is its mode that keeps each model's stage cut (the server's: it cannot re-cut live).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.planner.incremental import DEFAULT_HYSTERESIS, IncrementalPlanner, PricedAction

DEFAULT_THRESHOLD = 0.5  # a model's rate moved by more than half since the last plan
IDLE_FLOOR = 0.1  # rate changes are measured against at least this share of the mean rate


class RateMeter:
    """Per-model arrivals in a sliding window of `window` seconds."""

    def __init__(self, window: float, models=()):
        if not 0 < window < float("inf"):
            raise UserError(f"the rate window must be a number of seconds > 0, got {window}")
        self.window = window
        self.arrivals: dict[str, deque[float]] = {m: deque() for m in models}

    def observe(self, model: str, t: float) -> None:
        self.arrivals.setdefault(model, deque()).append(t)

    def rates(self, now: float) -> dict[str, float]:
        """Requests/s of every model seen (or named at start) over (now - window, now]."""
        out = {}
        for model, times in self.arrivals.items():
            while times and times[0] <= now - self.window:
                times.popleft()
            out[model] = sum(1 for t in times if t <= now) / self.window
        return out


@dataclass
class Replan:
    """A change to apply: the placement to serve next and the priced actions from the current one."""

    at: float
    placement: Placement
    actions: list[PricedAction]
    rates: dict[str, float]
    objective_before: float
    objective_after: float
    trigger: str  # "interval" or "threshold: <model>"


class ReplanController:
    """Meters rates and re-plans on an interval or a rate jump (see the module docstring)."""

    def __init__(self, config, placement: Placement, interval: float, threshold: float = DEFAULT_THRESHOLD,
                 hysteresis: float = DEFAULT_HYSTERESIS, window: float | None = None, start: float = 0.0,
                 keep_cuts: bool = False):
        if not 0 < interval < float("inf"):
            raise UserError(f"--replan-interval must be a number of seconds > 0, got {interval}")
        if not 0 < threshold < float("inf"):
            raise UserError(f"the re-planning threshold must be a relative rate change > 0 (e.g. 0.5), got {threshold}")
        self.planner = IncrementalPlanner(config, hysteresis, keep_cuts=keep_cuts)
        self.placement = placement
        self.interval = interval
        self.threshold = threshold
        self.meter = RateMeter(window if window is not None else min(interval, 60.0), placement.models)
        self.last_plan = start
        self.last_rates: dict[str, float] | None = None
        self.replans: list[Replan] = []

    def observe(self, model: str, t: float) -> None:
        self.meter.observe(model, t)

    def maybe_replan(self, now: float) -> Replan | None:
        """Re-plan if due; the `Replan` when the placement changes (it becomes the current one), else None."""
        if now - self.last_plan < self.meter.window:
            return None  # the meter does not yet cover a full window of traffic since the last plan
        rates = self.meter.rates(now)
        trigger = "interval" if now - self.last_plan >= self.interval else self._jump(rates)
        if self.last_rates is None and trigger is None:
            self.last_rates = rates  # the first full window: the rates later jumps are measured from
        if trigger is None:
            return None
        result = self.planner.replan(self.placement, rates)
        self.last_plan, self.last_rates = now, rates
        if not result.changed:
            return None
        self.placement = result.placement
        replan = Replan(now, result.placement, result.actions, rates, result.objective_before, result.objective_after, trigger)
        self.replans.append(replan)
        return replan

    def _jump(self, rates: dict[str, float]) -> str | None:
        """'threshold: <model>' for the first model whose rate moved by more than the threshold."""
        if self.last_rates is None:
            return None
        floor = IDLE_FLOOR * sum(self.last_rates.values()) / max(1, len(self.last_rates))
        for model, rate in rates.items():
            before = self.last_rates.get(model, 0.0)
            if abs(rate - before) > self.threshold * max(before, floor, 1e-12):
                return f"threshold: {model}"
        return None
