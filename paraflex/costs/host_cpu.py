"""The shared host CPU of a `device: cpu` cluster: engines that processor-share the machine's
cores, so a step (and a token's way back to the frontend) takes longer while other engines run.

Place in the data flow: `paraflex profile` records the machine's cores (`host_cores` in
profile.json). `paraflex profile CONFIG --step-log DIR` (a served run's engine step log) fits
`fit_host_cpu`: how many cores' worth of runnable work one busy engine puts on the host
(`demand_per_engine`: its torch threads, its loop, transport and output threads) and, from the
run's request log, each request in flight (`demand_per_request`: the client's, the gateway's and
the output router's work for an open request), chosen so that the step times de-stretched by
them and the engine loop's lines fitted on them (loop_fit.py) predict the logged steps best; it
stores a `HostCpu` under ``host_cpu`` next to the lines. The
simulator (simulator/core/cluster.py) reads it (serving_terms.host_cpu) and stretches every stage
execution by `stretch(busy engines)` (no idle headroom: work slows as soon as anything else runs
beside it, `HostCpu.stretch`), where the busy engines are the stepping engine plus the
mean number of other engines executing over the `window_s` before the step starts
(`busy_seconds` over the same timelines the fit reads from the step log), and the requests in
flight then; the return path (return_path.py) and the gateway's delay (serving_terms.GatewayTerm) are
latencies stretched by all engines busy over the window before a token (a request's HTTP
arrival) and the requests in flight then (`fit_stretched_latency` fits both, and how the logged
samples spread around them: latency_spread.py). The requests'
demand together is capped at `REQUEST_CORES`.

Off for GPU clusters (a GPU's host threads are not its compute): `host_cpu` returns None unless
the cluster's device is `cpu`. Pure: rows are dicts, times are floats.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from paraflex.costs.latency_spread import spread_of
from paraflex.costs.loop_fit import fit_loop_lines, loop_line_s

HOST_CPU_KEY = "host_cpu"
HOST_CORES_KEY = "host_cores"  # written by `paraflex profile` next to `threads`
WINDOW_S = 0.02  # the window before a step (or token) whose busy engines count
DEMANDS = tuple(0.25 * k for k in range(1, 17))  # cores' worth per busy engine the fit tries: 0.25 ... 4
PER_REQUEST = (0.0, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)  # ... per request in flight
# The most cores the open requests' work can take together: it runs in the load client, the
# gateway and the output router, each one Python process (one thread at a time under the GIL),
# so 3 cores however many requests are open. Modelled, not fitted: the calibration never opens
# enough requests to reach it (docs/simulate.md, "The shared host CPU").
REQUEST_CORES = 3.0


def busy_seconds(flat: Sequence[float], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by one engine's busy intervals `flat` ([start, end, start,
    end, ...] in time order, not overlapping)."""
    i = max(0, bisect_right(flat, t0) - 1)
    i -= i % 2  # the interval that may straddle t0
    total = 0.0
    while i < len(flat) and flat[i] < t1:
        total += max(0.0, min(flat[i + 1], t1) - max(flat[i], t0))
        i += 2
    return total


def engine_timelines(steps: list[dict]) -> dict[str, list[float]]:
    """Each logged engine's busy intervals (flat, in time order, back-to-back steps merged)."""
    by_engine: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in steps:
        start = float(s["start_s"])
        by_engine[s["engine"]].append((start, start + float(s["busy_s"])))
    out = {}
    for engine, intervals in by_engine.items():
        flat: list[float] = []
        for start, end in sorted(intervals):
            if flat and flat[-1] >= start:
                flat[-1] = max(flat[-1], end)
            else:
                flat += [start, end]
        out[engine] = flat
    return out


@dataclass(frozen=True)
class HostCpu:
    """`cores` shared by the engines and the serving processes: each busy engine puts
    `demand_per_engine` cores' worth of runnable work on them, each request in flight (HTTP
    arrival to finish: the client's, gateway's and output router's work for it)
    `demand_per_request`, all of them together at most `request_cores`; fitted from `steps`
    logged steps.

    No idle headroom: a piece of work runs at its alone speed only while nothing else is
    runnable, and every other core's worth of demand beside it slows it by 1 / `cores`, even
    while a core would be free on paper. Measured on the served steps of the 2-core machine: a
    decode step with another engine busy over part of the 20 ms before it (1.1-1.5 busy
    engines, at most 3 open requests) took 8-32% longer than with none, where a
    processor-sharing `max(1, demand / cores)` predicts no slowdown until the demand fills the
    cores (docs/simulate.md, "eighth pass")."""

    cores: int
    demand_per_engine: float
    demand_per_request: float = 0.0
    window_s: float = WINDOW_S
    steps: int = 0
    request_cores: float = REQUEST_CORES

    def stretch(self, busy_engines: float, in_flight: int = 0) -> float:
        """How much longer work takes while `busy_engines` engines (for a step: its own engine
        and the others) run and `in_flight` requests are open: 1 plus the demand besides one
        engine's over the cores, >= 1."""
        requests = min(in_flight * self.demand_per_request, self.request_cores)
        return max(1.0, 1.0 + ((busy_engines - 1.0) * self.demand_per_engine + requests) / self.cores)


def busy_engines(timelines: Iterable[Sequence[float]], t: float, window_s: float = WINDOW_S) -> float:
    """The mean number of engines (of `timelines`) executing over the `window_s` before t."""
    return sum(busy_seconds(flat, t - window_s, t) for flat in timelines) / window_s


def step_busy_engines(timelines: dict[str, list[float]], engine: str, t: float, window_s: float = WINDOW_S) -> float:
    """The engines a step of `engine` starting at t shares the host with: itself plus the mean
    number of the others executing over the `window_s` before t."""
    return 1.0 + busy_engines((flat for e, flat in timelines.items() if e != engine), t, window_s)


def in_flight_fn(requests: list[dict]) -> Callable[[float], int]:
    """The number of logged `requests` (request-log rows with an HTTP arrival) open at t."""
    events = sorted([(float(r["http_arrival_s"]), 1) for r in requests if r.get("http_arrival_s")]
                    + [(float(r["finish_s"]), -1) for r in requests if r.get("http_arrival_s")])
    times = [t for t, _ in events]
    level = [0]
    for _, step in events:
        level.append(level[-1] + step)
    return lambda t: level[bisect_right(times, t)]


def step_loads(rows: list[dict], requests: list[dict], window_s: float = WINDOW_S) -> tuple[list[float], list[int]]:
    """(busy engines, requests open) at each logged step of `rows`: its own engine and the others
    busy over the `window_s` before it, and the `requests` (request-log rows) open then."""
    timelines, open_at = engine_timelines(rows), in_flight_fn(requests)
    busy = [step_busy_engines(timelines, r["engine"], float(r["start_s"]), window_s) for r in rows]
    return busy, [open_at(float(r["start_s"])) for r in rows]


def step_stretches(rows: list[dict], host: HostCpu | None, requests: list[dict]) -> list[float]:
    """What `host` stretched each logged step of `rows` by, at its `step_loads` (None: 1 each)."""
    if host is None:
        return [1.0] * len(rows)
    return [host.stretch(b, n) for b, n in zip(*step_loads(rows, requests, host.window_s))]


def fit_stretched_latency(samples: list[tuple[float, float]], steps: list[dict], requests: list[dict],
                          host: HostCpu | None) -> tuple[float, list[float]]:
    """(the latency on a quiet host, its spread) of work logged as `samples` ((time it began,
    seconds it took)), stretched by `host` over the engines of step log `steps` busy in the window
    before it began and the `requests` (request-log rows) open then: least squares through the
    origin (`host` None: the mean); the spread (paraflex/costs/latency_spread.py) of the samples
    de-stretched, over that latency."""
    timelines, open_at = list(engine_timelines(steps).values()), in_flight_fn(requests)
    stretches = [1.0 if host is None else host.stretch(busy_engines(timelines, t, host.window_s), open_at(t))
                 for t, _ in samples]
    latency = max(0.0, sum(s * x for s, (_, x) in zip(stretches, samples)) / sum(s * s for s in stretches))
    spread = spread_of([x / (s * latency) for s, (_, x) in zip(stretches, samples)]) if latency > 0 else []
    return latency, spread


def fit_host_cpu(rows: list[dict], stage_time: Callable[[dict], float], cores: int,
                 requests: list[dict] | None = None) -> tuple[HostCpu, dict]:
    """(the HostCpu, the engine loop's lines fitted on the steps de-stretched by it) whose
    prediction `(stage_time + line) x stretch` of the logged steps `rows` has the least squared
    error, over a grid of demands per engine (up to `cores`) and,
    with the served `requests` of the same run, per request in flight (else 0; only demands whose
    requests stay under `REQUEST_CORES` in these steps: the cap is an extrapolation, never fitted)."""
    busy, in_flight = step_loads(rows, requests or [])
    compute = {id(r): stage_time(r) for r in rows}  # once per row, not once per grid point
    best = None
    # the open requests' cap is not seen in the calibration: only demands that stay under it there
    per_requests = [c for c in PER_REQUEST if c * max(in_flight, default=0) <= REQUEST_CORES] if requests else [0.0]
    for per_engine in [d for d in DEMANDS if d <= cores]:
        for per_request in per_requests:
            host = HostCpu(cores, per_engine, per_request, WINDOW_S, len(rows))
            stretches = [host.stretch(b, n) for b, n in zip(busy, in_flight)]
            lines = fit_loop_lines(rows, lambda r: compute[id(r)], stretches)
            error = 0.0
            for r, s in zip(rows, stretches):
                line = loop_line_s(lines, r)
                if line is not None:
                    error += (float(r["busy_s"]) - (compute[id(r)] + line) * s) ** 2
            if best is None or error < best[0]:
                best = (error, host, lines)
    return best[1], best[2]
