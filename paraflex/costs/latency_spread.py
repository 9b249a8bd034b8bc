"""How a served latency spreads around its fitted value: the quantiles of the logged samples over
the fitted latency (each sample de-stretched by the shared host CPU first).

Place in the data flow: `fit_stretched_latency` (paraflex/costs/host_cpu.py) returns a spread
beside each latency it fits: the gateway's delay, a token's way back (return_path.py), the
served hop and token message (served_hop.py). profile.json keeps it in the term; the simulator
(simulator/core/cluster.py) draws each delay as latency x `spread_ratio(spread, u)` x the host's
stretch with u from its seeded generator, so the simulated delays spread as the served ones did.
An empty spread (a profile from before, or a term fitted from no samples) is the latency itself.

Why: the served latencies are skewed (on the 2-vCPU machine the way back of a token was 2.5-3.8 ms
at the 10th percentile, 5.3-9.9 ms at the median and 11-20 ms at the 90th); one constant at the
fitted (mean-like) latency put the simulated TTFT median over the served one and its P99 under
(docs/simulate.md, "Spread latencies"). Pure.
"""

from __future__ import annotations

# Quantiles kept: every 1%, so that the simulated P99 draws the logged P99 (with every 2% it drew
# halfway between the 98th percentile and the largest sample: 2-4x the logged P99 where one
# sample was a one-off, e.g. a 38x gateway delay in 408).
SPREAD_POINTS = 101


def spread_of(ratios: list[float]) -> list[float]:
    """The `SPREAD_POINTS` quantiles (0, 1%, ..., 100%, linear between order statistics) of
    `ratios` (samples over the fitted latency), each at least 0 (a token's way back can log
    below zero: its step's end includes the output push that sent it); [] for none."""
    if not ratios:
        return []
    xs = sorted(max(0.0, r) for r in ratios)
    return [spread_ratio(xs, i / (SPREAD_POINTS - 1)) for i in range(SPREAD_POINTS)]


def spread_ratio(spread: list[float], u: float | None) -> float:
    """The ratio at quantile u (0 <= u <= 1) of `spread` (any sorted values), linear between its
    points; 1 for an empty spread or u None (the fitted latency itself)."""
    if not spread or u is None:
        return 1.0
    pos = u * (len(spread) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(spread) - 1)
    return spread[lo] + (spread[hi] - spread[lo]) * (pos - lo)
