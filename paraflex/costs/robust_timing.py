"""Statistics for timings taken on a shared machine, where other tenants only ever add time and
come in stretches: the robust value of a point measured in rounds, how far the rounds disagree,
a Theil-Sen line and its outliers, and monotonicity in the step's size.

Place in the data flow: `paraflex profile` measures op tables (engine/worker/op_profiler.py)
and whole engine steps (paraflex/serving/step_profiler.py) in rounds; both reduce their
samples here, re-measure the points that break what physics says (a bigger step never costs
less; a point far off the line of the others), and store the rounds' spread in profile.json
(`noise`) so a bench can warn before trusting a profile. Pure: no torch, no I/O.
"""

from __future__ import annotations

import statistics

MONOTONE_TOL = 0.10  # a point may cost this share more than a bigger one before it counts as a break
OUTLIER_TOL = 0.25  # a point this share off the Theil-Sen line of its kind is re-measured
OUTLIER_ABS_S = 200e-6  # ... and at least this far (tiny steps wobble by tens of microseconds)


def robust_time(rounds: list[list[float]]) -> float:
    """The median of the per-round minima: each round's fastest run is its undisturbed cost,
    the median over rounds drops a round that a busy stretch held from start to end."""
    return statistics.median(min(r) for r in rounds if r)


def spread(rounds: list[list[float]]) -> float:
    """How far the rounds' minima disagree: (max - min) / median of the per-round minima
    (0 for one round)."""
    minima = [min(r) for r in rounds if r]
    mid = statistics.median(minima)
    return (max(minima) - min(minima)) / mid if mid > 0 else 0.0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of a Theil-Sen line: the median of the pairwise slopes, then the median
    intercept, so one point a busy machine inflated does not tilt it (one point: a flat line)."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - slope * x for x, y in zip(xs, ys)), slope


def line_outliers(xs: list[float], ys: list[float], rel_tol: float = OUTLIER_TOL,
                  abs_tol: float = OUTLIER_ABS_S) -> list[int]:
    """Indices of the points farther than max(abs_tol, rel_tol * |line|) from the Theil-Sen line
    through all points (fewer than three points: none, a line fits them)."""
    if len(xs) < 3:
        return []
    a, b = fit_line(xs, ys)
    return [i for i, (x, y) in enumerate(zip(xs, ys)) if abs(y - (a + b * x)) > max(abs_tol, rel_tol * abs(a + b * x))]


def monotone_breaks(ys: list[float], rel_tol: float = MONOTONE_TOL) -> list[int]:
    """Indices (of `ys`, ordered by growing size) in a pair where the smaller size costs more
    than rel_tol over the bigger one: both points of every such pair, sorted."""
    bad = set()
    for i in range(len(ys)):
        for j in range(i + 1, len(ys)):
            if ys[i] > ys[j] * (1 + rel_tol):
                bad.update((i, j))
    return sorted(bad)


def make_monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a run of
    points that decreases is replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]
