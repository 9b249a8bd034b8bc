"""Aegaeon's decode time quotas (SOSP'25 §4.3, Eq. 2 and 3): how long each batch of a decode
instance's work list decodes in one round of weighted round-robin turns.

n_k = d_k / t_k (steps a batch may run per deadline), S = sum_k 1/n_k, c = the switch cost of
one round, alpha = max(c / (min_k n_k * Q_MAX) + S, 0.5), q_i = c / (n_i (alpha - S)).
With no switch in the round (c = 0: one model) every batch gets Q_MAX (the formula's 0 would
stall the instance); `decode_worklist.py` recomputes quotas at each round.
"""

from __future__ import annotations

Q_MAX_S = 4.0  # the paper's maximum quota
MIN_ALPHA = 0.5


def wrr_quotas(deadlines: list[float], step_times: list[float], switch_cost: float,
               q_max: float = Q_MAX_S) -> tuple[float, list[float]]:
    """(alpha, quota per batch) for batches with TBT deadlines `deadlines` and decode step
    times `step_times` (seconds), `switch_cost` (c) the round's total model-switch time."""
    if not deadlines:
        return MIN_ALPHA, []
    n = [d / max(t, 1e-9) for d, t in zip(deadlines, step_times)]
    s = sum(1.0 / k for k in n)
    alpha = max(switch_cost / (min(n) * q_max) + s, MIN_ALPHA)
    if switch_cost <= 0:
        return alpha, [q_max] * len(n)
    return alpha, [switch_cost / (k * (alpha - s)) for k in n]
