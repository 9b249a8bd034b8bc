"""Prompt and output token counts of each request.

`builtin` follows §2.1's reading of the Azure conversation trace: a long-tailed mixture where
90% of responses average 59 tokens and 10% average 478, with prompts following the same
shape; each component is log-normal (sigma 0.8) around its mean. `trace` takes the counts of
the replayed trace rows (or random rows when arrivals are synthetic). generator.py then
applies the context/output scaling of §8.3 and the model's context limit.
"""

from __future__ import annotations

import numpy as np

from paraflex.simulator.registry import Registry
from paraflex.simulator.workload.trace import MAX_TOKENS, Trace

LENGTH_SOURCES: Registry = Registry("length source")

SHORT_MEAN, LONG_MEAN, LONG_SHARE, SIGMA = 59.0, 478.0, 0.10, 0.8


def _mixture(rng: np.random.Generator, n: int) -> np.ndarray:
    long = rng.random(n) < LONG_SHARE
    mean = np.where(long, LONG_MEAN, SHORT_MEAN)
    mu = np.log(mean) - SIGMA * SIGMA / 2
    return np.maximum(1, np.rint(rng.lognormal(0.0, SIGMA, n) * np.exp(mu))).astype(np.int64)


@LENGTH_SOURCES.register("builtin")
def builtin(rng: np.random.Generator, n: int, rows: np.ndarray | None, trace: Trace | None):
    return _mixture(rng, n), _mixture(rng, n)


@LENGTH_SOURCES.register("trace")
def from_trace(rng: np.random.Generator, n: int, rows: np.ndarray | None, trace: Trace | None):
    assert trace is not None
    if rows is None:
        rows = rng.integers(len(trace), size=n)
    return trace.prompt[rows].copy(), trace.output[rows].copy()


def scale(lengths: np.ndarray, factor: float) -> np.ndarray:
    if factor == 1.0:
        return lengths
    return np.clip(np.rint(lengths * factor), 1, MAX_TOKENS).astype(np.int64)  # (clip_to_context cuts to the context)


def clip_to_context(prompt: np.ndarray, output: np.ndarray, max_context: int):
    """Keep prompt + output within the model's context: prompts are cut to leave room for
    one output token, outputs to the remaining room. Returns (prompt, output, n_clipped)."""
    p = np.minimum(prompt, max_context - 1)
    o = np.minimum(output, max_context - p)
    clipped = int(np.count_nonzero((p != prompt) | (o != output)))
    return p, o, clipped

