"""Per-model arrival processes: arrival times in [0, horizon) at a given rate.

Registered by name (`poisson`, `lognormal`, `trace`); generator.py calls one per model with
that model's own random generator, so each model's requests arrive independently (§8.1).
A trace replay also returns the trace row of each arrival so lengths can follow it.
"""

from __future__ import annotations

import math

import numpy as np

from paraflex.simulator.registry import Registry
from paraflex.simulator.workload.trace import Trace

ARRIVAL_PROCESSES: Registry = Registry("arrival process")


def _cumulate(gaps_fn, rate: float, horizon: float) -> np.ndarray:
    """Draw gaps in chunks until the horizon is passed; return times < horizon."""
    out: list[np.ndarray] = []
    t = 0.0
    chunk = max(16, int(rate * horizon * 1.2) + 16)
    while t < horizon:
        times = t + np.cumsum(gaps_fn(chunk))
        out.append(times)
        t = float(times[-1])
    times = np.concatenate(out) if out else np.empty(0)
    return times[times < horizon]


@ARRIVAL_PROCESSES.register("poisson")
def poisson(rng: np.random.Generator, rate: float, horizon: float, cv: float = 1.0, trace: Trace | None = None):
    """Exponential inter-arrivals (CV = 1); `cv` is ignored."""
    return _cumulate(lambda n: rng.exponential(1.0 / rate, n), rate, horizon), None


@ARRIVAL_PROCESSES.register("lognormal")
def lognormal(rng: np.random.Generator, rate: float, horizon: float, cv: float = 1.0, trace: Trace | None = None):
    """Log-normal inter-arrivals with mean 1/rate and coefficient of variation `cv` (§8.3):
    sigma^2 = ln(1 + cv^2), mu = ln(1/rate) - sigma^2 / 2."""
    sigma2 = math.log1p(cv * cv)
    mu = math.log(1.0 / rate) - sigma2 / 2
    return _cumulate(lambda n: rng.lognormal(mu, math.sqrt(sigma2), n), rate, horizon), None


@ARRIVAL_PROCESSES.register("trace")
def trace_replay(rng: np.random.Generator, rate: float, horizon: float, cv: float = 1.0, trace: Trace | None = None):
    """Replay the trace's inter-arrival gaps from a random start row (wrapping around),
    stretched by native_rate / rate so the model sees `rate` on average (§8.1)."""
    assert trace is not None
    gaps = trace.interarrivals * (trace.rate / rate)
    n_rows = len(trace)
    start = int(rng.integers(n_rows))
    period = float(gaps.sum())
    laps = int(horizon // period) + 2
    order = (start + np.arange(n_rows * laps)) % n_rows
    # the first request of the replay arrives after a random fraction of its gap
    times = np.cumsum(gaps[order]) - gaps[order[0]] * float(rng.random())
    keep = times < horizon
    return times[keep], order[keep]
