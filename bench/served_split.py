"""Where a served request's time goes, from `paraflex serve --request-log` and `--step-log`
together (bench/sim_fidelity.py prints it per load and model next to the simulator's terms).

Each step row names the engine request ids of its batch (engine/step_log.py), which are the
request log's ids, so a request's own steps are found exactly:

  gateway      HTTP arrival -> the frontend takes it (the request log)
  to prefill   the frontend -> its first stage's prefill step starts (submission, the engine's
               queue)
  prefill      that start -> the end of its last stage's prefill step (stages, hops between)
  back         that end -> the first token at the frontend (output push, OutputRouter, the
               gateway's long poll)

and `hops`: for a batch that a stage hands to the next one on another engine, the time from the
end of the sending step to the start of the receiving one, counted only where the receiving
engine was idle in between (no queueing in it): the served hop, wake-up included.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

PARTS = ("gateway", "to prefill", "prefill", "back")


def _end(step: dict) -> float:
    return float(step["start_s"]) + float(step["busy_s"])


def ttft_parts(requests: list[dict], steps: list[dict]) -> dict[str, dict[str, float]]:
    """model -> part -> median seconds over `requests` (request-log rows with an HTTP arrival)
    whose prefill steps are in `steps`; plus "requests" (how many)."""
    prefill_steps: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        if s["kind"] != "decode":
            for rid in s.get("req_ids", "").split():
                prefill_steps[rid].append(s)
    parts: dict[str, list[tuple]] = defaultdict(list)
    for r in requests:
        mine = prefill_steps.get(r["id"])
        if not mine or not r.get("http_arrival_s"):
            continue
        first = min(mine, key=lambda s: (int(s["stage"]), float(s["start_s"])))
        last_stage = max(int(s["stage"]) for s in mine)
        done = max(_end(s) for s in mine if int(s["stage"]) == last_stage)
        arrival, start = float(r["arrival_s"]), float(first["start_s"])
        parts[r["model"]].append((arrival - float(r["http_arrival_s"]), start - arrival, done - start,
                                  float(r["first_token_s"]) - done))
    return {m: {**{p: statistics.median(v) for p, v in zip(PARTS, zip(*rows))}, "requests": len(rows)}
            for m, rows in sorted(parts.items())}


def hops(steps: list[dict]) -> list[float]:
    """Served hops (seconds) between the stages of one batch, where the receiver was idle."""
    by_engine: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        by_engine[s["engine"]].append(s)
    idle_since = {}  # id(step) -> when its engine's previous step ended
    for rows in by_engine.values():
        rows.sort(key=lambda s: float(s["start_s"]))
        for prev, s in zip([None] + rows, rows):
            idle_since[id(s)] = _end(prev) if prev is not None else 0.0
    sent: dict[tuple, list[dict]] = defaultdict(list)  # the same requests' steps, one per token
    for s in steps:
        sent[(s["model"], int(s["stage"]), s["kind"], s.get("req_ids", ""))].append(s)
    out = []
    for s in steps:
        stage, start = int(s["stage"]), float(s["start_s"])
        earlier = [p for p in sent.get((s["model"], stage - 1, s["kind"], s.get("req_ids", "")), [])
                   if _end(p) <= start] if stage > 0 else []
        if earlier:
            src = max(earlier, key=_end)  # the step that handed this batch over
            if src["engine"] != s["engine"] and idle_since[id(s)] <= _end(src):
                out.append(start - _end(src))
    return out
