"""The served return path of a token as a function of how busy the engines are, fitted from a
served run's step log and request log together.

Place in the data flow: `paraflex serve --step-log DIR --request-log FILE` logs every engine
step with the request ids of its batch (engine/step_log.py) and every request's first-token and
finish time at the frontend (paraflex/serving/request_log.py). `paraflex profile CONFIG
--gateway-log FILE --step-log DIR` calls `fit_return_path`: per logged request, the way back of
its first token (end of its last-stage prefill step -> first token at the frontend) and of its
last (end of its last step -> finish), against `busy_seconds` of every engine over the window
before that step ended; a least-squares line gives a `ReturnPathTerm`
(paraflex/costs/serving_terms.py, `return_path` in profile.json). The simulator measures the same
busy engines over the same window from its own engine timeline (simulator/core/cluster.py,
`busy_seconds` again) and adds the line to every token it records. Pure: rows are dicts.

Why busy engines and not the token rate: on the 2-vCPU machine the way back of a token was
~4 ms while at most one engine was executing and 8-9 ms while both were (the output push, the
OutputRouter actor and the gateway's poller thread wait for a core), a clearer signal than the
token rate before it (docs/simulate.md, fifth pass).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from typing import Sequence

from paraflex.costs.serving_terms import ReturnPathTerm

WINDOW_S = 0.02  # the window before a token whose busy engines count


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


def engine_timelines(steps: list[dict]) -> list[list[float]]:
    """Each logged engine's busy intervals (flat, in time order, back-to-back steps merged)."""
    by_engine: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in steps:
        start = float(s["start_s"])
        by_engine[s["engine"]].append((start, start + float(s["busy_s"])))
    out = []
    for intervals in by_engine.values():
        flat: list[float] = []
        for start, end in sorted(intervals):
            if flat and flat[-1] >= start:
                flat[-1] = max(flat[-1], end)
            else:
                flat += [start, end]
        out.append(flat)
    return out


def token_backs(requests: list[dict], steps: list[dict]) -> list[tuple[float, float]]:
    """(step end, way back in seconds) of the first and the last token of every request in
    `requests` (request-log rows) whose last-stage steps are in `steps`."""
    last_stage: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for s in steps:
        if int(s["stage"]) == int(s["num_stages"]) - 1:
            end = float(s["start_s"]) + float(s["busy_s"])
            for rid in (s.get("req_ids") or "").split():
                last_stage[rid].append((end, s["kind"]))
    out = []
    for r in requests:
        mine = sorted(last_stage.get(r["id"], []))
        prefill = [end for end, kind in mine if kind != "decode"]
        if not prefill:
            continue
        out.append((prefill[-1], float(r["first_token_s"]) - prefill[-1]))
        if int(r["output_tokens"]) > 1 and mine[-1][1] == "decode":
            out.append((mine[-1][0], float(r["finish_s"]) - mine[-1][0]))
    return out


def fit_return_path(requests: list[dict], steps: list[dict], window_s: float = WINDOW_S) -> ReturnPathTerm | None:
    """The least-squares line of the way back in the busy engines before it (intercept and slope
    kept >= 0); None where no request of `requests` has its steps in `steps`."""
    backs = token_backs(requests, steps)
    if not backs:
        return None
    timelines = engine_timelines(steps)
    xs = [sum(busy_seconds(f, t - window_s, t) for f in timelines) / window_s for t, _ in backs]
    ys = [b for _, b in backs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx) if sxx > 0 else 0.0
    return ReturnPathTerm(max(0.0, my - slope * mx), slope, window_s, n)
