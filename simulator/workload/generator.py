"""Turn a `WorkloadSpec`, the served models and a total rate into time-ordered requests.

Total rate -> per-model rates (popularity.py) -> per-model arrivals (arrivals.py), each model
with its own generator spawned from the run seed (adding a model never changes another's
draws) -> lengths (lengths.py), scaled and clipped to the model's context. The result feeds
the simulator's arrival events; `info` (counts, realised shares, clipped requests) goes to
the summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraflex.simulator.workload.arrivals import ARRIVAL_PROCESSES
from paraflex.simulator.workload.lengths import LENGTH_SOURCES, clip_to_context, scale
from paraflex.simulator.workload.popularity import proportional_shares, zipf_shares
from paraflex.simulator.workload.spec import WorkloadSpec
from paraflex.simulator.workload.trace import load_trace


@dataclass(frozen=True)
class WorkloadModel:
    """What the workload needs to know about a served model."""

    name: str
    size_bytes: int  # orders Zipf popularity (smallest = most popular)
    max_context: int
    rate: float = 0.0  # configured rate, used by popularity `config`


@dataclass(slots=True)
class SimRequest:
    id: int
    model: str
    arrival: float
    prompt_len: int
    output_len: int


def model_rates(models: list[WorkloadModel], total_rate: float, spec: WorkloadSpec) -> list[float]:
    if spec.popularity == "zipf":
        shares = zipf_shares([m.size_bytes for m in models], spec.zipf_alpha)
    elif spec.popularity == "uniform":
        shares = [1.0 / len(models)] * len(models)
    else:
        shares = proportional_shares([m.rate for m in models])
    return [total_rate * s for s in shares]


def generate(models: list[WorkloadModel], total_rate: float, spec: WorkloadSpec, seed: int):
    """Return (requests sorted by arrival with ids 0..n-1, info dict)."""
    spec.validate()
    trace = load_trace(spec.trace) if spec.trace and (spec.arrival == "trace" or spec.lengths == "trace") else None
    horizon = spec.num_requests / total_rate
    arrive = ARRIVAL_PROCESSES.get(spec.arrival, "workload.arrival")
    lengths = LENGTH_SOURCES.get(spec.lengths, "workload.lengths")
    rows: list[tuple[float, int, int, int]] = []
    per_model: dict[str, dict] = {}
    for i, (m, rate) in enumerate(zip(models, model_rates(models, total_rate, spec))):
        rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(i,)))
        if rate <= 0:
            per_model[m.name] = {"rate": 0.0, "requests": 0, "clipped": 0}
            continue
        times, trace_rows = arrive(rng, rate, horizon, cv=spec.cv, trace=trace)
        prompt, output = lengths(rng, len(times), trace_rows, trace)
        prompt = scale(prompt, spec.context_scale)
        output = scale(output, spec.output_scale)
        prompt, output, clipped = clip_to_context(prompt, output, m.max_context)
        per_model[m.name] = {"rate": rate, "requests": int(len(times)), "clipped": clipped}
        rows.extend(zip(times.tolist(), [i] * len(times), prompt.tolist(), output.tolist()))
    rows.sort(key=lambda r: (r[0], r[1]))
    requests = [SimRequest(k, models[i].name, t, p, o) for k, (t, i, p, o) in enumerate(rows)]
    info = {"horizon_s": horizon, "total_rate": total_rate, "requests": len(requests), "models": per_model}
    return requests, info
