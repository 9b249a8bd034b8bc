"""Time-varying per-model rates: a rate multiplier over time (steps, ramps, a diurnal curve, a
trace's own arrival curve, idle gaps) and the time warp that makes any arrival process follow it.

Place in the data flow: `generator.generate(..., schedules={model: RateSchedule})` draws a
scheduled model's arrivals from its usual process (Poisson, log-normal, trace gaps) in
*operational* time at the model's base rate, then maps each operational instant s to the real
instant t with M(t) = s, where M(t) is the integral of the multiplier m over [0, t]: the
process keeps its burstiness, and its rate at t is base rate x m(t) (0 in an idle gap). The
live re-planning bench (bench/replan.py) and `paraflex simulate --rate-schedule` use it.

A schedule is piecewise linear through its knots (t, m), flat before the first and after the
last; two knots at the same instant make a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paraflex.errors import UserError

_GRID = 64  # points per segment when inverting M


@dataclass(frozen=True)
class RateSchedule:
    """A rate multiplier m(t) >= 0, piecewise linear through (times[k], values[k])."""

    times: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self):
        if not self.times or len(self.times) != len(self.values):
            raise UserError("a rate schedule needs one or more (time, multiplier) points")
        if any(not math.isfinite(t) or t < 0 for t in self.times) or list(self.times) != sorted(self.times):
            raise UserError(f"rate schedule times must be finite, >= 0 and non-decreasing, got {list(self.times)}")
        if any(not (0 <= v < math.inf) for v in self.values):
            raise UserError(f"rate schedule multipliers must be finite numbers >= 0, got {list(self.values)}")

    # --- shapes --------------------------------------------------------------------------
    @classmethod
    def steps(cls, points) -> "RateSchedule":
        """m = points[k][1] from points[k][0] until the next point (a 0 is an idle gap)."""
        times, values = [], []
        for k, (t, v) in enumerate(points):
            if k:
                times.append(float(t))
                values.append(values[-1])
            times.append(float(t))
            values.append(float(v))
        return cls(tuple(times), tuple(values))

    @classmethod
    def ramp(cls, t0: float, t1: float, v0: float, v1: float) -> "RateSchedule":
        """m = v0 until t0, linear to v1 at t1, v1 after."""
        return cls((float(t0), float(t1)), (float(v0), float(v1)))

    @classmethod
    def diurnal(cls, period_s: float, low: float, high: float, horizon_s: float, phase_s: float = 0.0) -> "RateSchedule":
        """A day's swing compressed into `period_s`: low at t = phase, high half a period later (cosine)."""
        if not period_s > 0:
            raise UserError(f"a diurnal schedule needs period_s > 0, got {period_s}")
        t = np.linspace(0.0, horizon_s, max(2, int(math.ceil(horizon_s / period_s * 48)) + 1))
        m = low + (high - low) * (1 - np.cos(2 * math.pi * (t - phase_s) / period_s)) / 2
        return cls(tuple(t.tolist()), tuple(m.tolist()))

    @classmethod
    def from_arrivals(cls, arrivals, window_s: float) -> "RateSchedule":
        """The arrival curve of a trace's own arrivals, as steps of `window_s`, mean 1."""
        arrivals = np.asarray(arrivals, dtype=float)
        if len(arrivals) == 0 or not window_s > 0:
            raise UserError("a schedule from arrivals needs at least one arrival and window_s > 0")
        counts = np.bincount((arrivals // window_s).astype(np.int64))
        mean = counts.mean()
        return cls.steps([(k * window_s, c / mean) for k, c in enumerate(counts)])

    # --- the time warp -------------------------------------------------------------------
    def at(self, t: float) -> float:
        return float(np.interp(t, self.times, self.values))

    def _grid(self, horizon: float) -> tuple[np.ndarray, np.ndarray]:
        """Instants over [0, horizon] and M at each (exact on knots; the multiplier is linear between)."""
        knots = sorted({0.0, horizon, *[t for t in self.times if t < horizon]})
        pieces = [np.linspace(a, b, _GRID + 1)[:-1] for a, b in zip(knots, knots[1:])]
        t = np.concatenate(pieces + [np.array([horizon])]) if pieces else np.array([0.0, horizon])
        # each sub-interval lies within one linear piece: its integral is m(midpoint) x length
        mid = (t[:-1] + t[1:]) / 2
        cumulative = np.concatenate([[0.0], np.cumsum(np.interp(mid, self.times, self.values) * np.diff(t))])
        return t, cumulative

    def cumulative(self, horizon: float) -> float:
        """M(horizon): the operational time the window [0, horizon] holds."""
        return float(self._grid(horizon)[1][-1])

    def warp(self, operational, horizon: float) -> np.ndarray:
        """Real instants of operational instants in [0, M(horizon))."""
        t, cumulative = self._grid(horizon)
        return np.interp(np.asarray(operational, dtype=float), cumulative, t)


def parse_schedules(raw, models) -> dict[str, RateSchedule]:
    """`{model: {kind: steps, points: [[t, m], ...]} | {kind: ramp, t0, t1, v0, v1} |
    {kind: diurnal, period_s, low, high, horizon_s[, phase_s]}}` (a `--rate-schedule` file)."""
    if not isinstance(raw, dict) or not raw:
        raise UserError("a rate schedule file maps model names to schedules, e.g. {m: {kind: steps, points: [[0, 1], [300, 3]]}}")
    out = {}
    for model, spec in raw.items():
        if model not in models:
            raise UserError(f"rate schedule for unknown model {model!r}; models: {', '.join(models)}")
        kind = spec.get("kind") if isinstance(spec, dict) else None
        try:
            if kind == "steps":
                out[model] = RateSchedule.steps(spec["points"])
            elif kind == "ramp":
                out[model] = RateSchedule.ramp(spec["t0"], spec["t1"], spec["v0"], spec["v1"])
            elif kind == "diurnal":
                out[model] = RateSchedule.diurnal(spec["period_s"], spec["low"], spec["high"], spec["horizon_s"],
                                                  spec.get("phase_s", 0.0))
            else:
                raise UserError(f"rate schedule of {model!r}: kind must be steps, ramp or diurnal, got {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"rate schedule of {model!r} ({kind}): missing or bad field {exc}; see docs/simulate.md") from None
    return out
