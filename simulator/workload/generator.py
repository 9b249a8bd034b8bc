"""Turn the workload section, the served models and a total rate into time-ordered requests.

Per-model rates = total rate x the model's share (WorkloadConfig.model_shares: Zipf in listed
order, or the configured relative rates) -> per-model arrivals (arrivals.py), each model with
its own generator spawned from the run seed (adding a model never changes another's draws)
-> token counts (lengths.py: the trace's when a trace is given, else the §2.1 built-in),
scaled (§8.3) and clipped to the model's context. The result feeds the simulator's arrival
events; `info` (counts, rates, clipped requests) goes to the summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraflex.config.workload import WorkloadConfig
from paraflex.errors import UserError
from paraflex.simulator.workload.arrivals import ARRIVAL_PROCESSES
from paraflex.simulator.workload.lengths import LENGTH_SOURCES, clip_to_context, scale
from paraflex.simulator.workload.trace import load_trace

DEFAULT_NUM_REQUESTS = 2000


@dataclass(frozen=True)
class WorkloadModel:
    """What the workload needs to know about a served model."""

    name: str
    max_context: int
    share: float  # fraction of the total rate


@dataclass(slots=True)
class SimRequest:
    id: int
    model: str
    arrival: float
    prompt_len: int
    output_len: int


MAX_REQUESTS = 100_000_000  # per run: beyond it the arrays alone pass the memory of a large host


def workload_of(config):
    """The config's workload section, or the defaults when it has none."""
    return config.workload if config.workload is not None else WorkloadConfig()


def horizon_s(workload, total_rate: float) -> float:
    """Arrival window: `duration_s` when set, else `num_requests` (default 2000) / rate."""
    if getattr(workload, "duration_s", None):
        return float(workload.duration_s)
    return (getattr(workload, "num_requests", None) or DEFAULT_NUM_REQUESTS) / total_rate


def check_request_count(workload, total_rate: float) -> float:
    """The arrival window, a UserError when `total_rate` over it draws more than MAX_REQUESTS
    (checked by `generate`, and by `paraflex simulate` before it makes a results folder)."""
    horizon = horizon_s(workload, total_rate)
    expected = total_rate * horizon
    if not expected <= MAX_REQUESTS:  # (inf and nan too)
        raise UserError(f"the workload would draw ~{expected:.3g} requests (rate {total_rate:g} req/s x {horizon:g} s); "
                        f"at most {MAX_REQUESTS:,} per run: lower duration_s / num_requests or the rate")
    return horizon


def generate(models: list[WorkloadModel], workload, total_rate: float, seed: int, schedules=None):
    """Return (requests sorted by arrival with ids 0..n-1, info dict).

    `workload` has the fields of paraflex.config.schema.WorkloadConfig (arrival, cv, trace,
    duration_s, num_requests, prompt_scale, output_scale). `schedules` (model -> a
    schedule.RateSchedule) make a model's rate vary over time: its base rate x the multiplier."""
    if not total_rate > 0:
        raise UserError(f"rate must be > 0 requests/s, got {total_rate}")
    trace = load_trace(workload.trace) if workload.trace else None
    if workload.arrival == "trace" and trace is None:
        raise UserError("workload.arrival is trace but no trace CSV is given; set workload.trace or pass --trace")
    horizon = check_request_count(workload, total_rate)
    arrive = ARRIVAL_PROCESSES.get(workload.arrival, "workload.arrival")
    lengths = LENGTH_SOURCES.get("trace" if trace is not None else "builtin")
    rows: list[tuple[float, int, int, int]] = []
    per_model: dict[str, dict] = {}
    for i, m in enumerate(models):
        rate = total_rate * m.share
        rng = np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=(i,)))
        if rate <= 0:
            per_model[m.name] = {"rate": 0.0, "requests": 0, "clipped": 0}
            continue
        schedule = (schedules or {}).get(m.name)
        if schedule is None:
            times, trace_rows = arrive(rng, rate, horizon, cv=workload.cv, trace=trace)
        else:
            times, trace_rows = arrive(rng, rate, schedule.cumulative(horizon), cv=workload.cv, trace=trace)
            times = schedule.warp(times, horizon)
        prompt, output = lengths(rng, len(times), trace_rows, trace)
        prompt = scale(prompt, workload.prompt_scale)
        output = scale(output, workload.output_scale)
        prompt, output, clipped = clip_to_context(prompt, output, m.max_context)
        per_model[m.name] = {"rate": rate, "requests": int(len(times)), "clipped": clipped}
        rows.extend(zip(times.tolist(), [i] * len(times), prompt.tolist(), output.tolist()))
    rows.sort(key=lambda r: (r[0], r[1]))
    requests = [SimRequest(k, models[i].name, t, p, o) for k, (t, i, p, o) in enumerate(rows)]
    info = {"horizon_s": horizon, "total_rate": total_rate, "requests": len(requests), "models": per_model}
    return requests, info
