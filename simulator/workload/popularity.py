"""Model popularity: the share of the total request rate each model receives.

§2.1/§8.1: popularity follows Zipf (alpha = 1.01 by default), inversely ordered by model size,
so the smallest model is the most popular (49% of requests for four models). Used by
generator.py to split the total `--rate` into per-model rates.
"""

from __future__ import annotations


def zipf_shares(sizes: list[float], alpha: float) -> list[float]:
    """Share of model i ∝ rank_i^-alpha, rank 1 = smallest size; ties keep input order."""
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    weights = [0.0] * len(sizes)
    for rank, i in enumerate(order, start=1):
        weights[i] = rank ** -alpha
    total = sum(weights)
    return [w / total for w in weights]


def proportional_shares(rates: list[float]) -> list[float]:
    total = sum(rates)
    if total <= 0:
        return [1.0 / len(rates)] * len(rates)
    return [r / total for r in rates]
