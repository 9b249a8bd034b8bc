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

and the served hand-overs between engines where the receiving engine was idle (no queueing in it;
paraflex/costs/served_hop.py, `handovers`): the hop to the next stage and the token message back
to the first stage, wake-up included.

`step_split` and `served_parts` put a load window's served steps and TTFT parts next to the
simulator's terms for them (the lines bench/sim_fidelity.py prints per load).
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict

import numpy as np

from paraflex.costs.host_cpu import step_stretches
from paraflex.costs.loop_fit import read_step_log, stage_time_fn, step_end
from paraflex.costs.served_hop import handovers
from paraflex.costs.serving_terms import gateway, host_cpu, measured_hop, request_delay_s, return_path, served_hop

PARTS = ("gateway", "to prefill", "prefill", "back")


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
        done = max(step_end(s) for s in mine if int(s["stage"]) == last_stage)
        arrival, start = float(r["arrival_s"]), float(first["start_s"])
        parts[r["model"]].append((arrival - float(r["http_arrival_s"]), start - arrival, done - start,
                                  float(r["first_token_s"]) - done))
    return {m: {**{p: statistics.median(v) for p, v in zip(PARTS, zip(*rows))}, "requests": len(rows)}
            for m, rows in sorted(parts.items())}


def step_split(config, placement, steps_dir: str, start: float, end: float, log_path: str | None = None) -> str:
    """Where a window's decode time goes: the served engine steps (mean loop iteration per stage
    step, from the step log) against the simulator's time for the very same steps, stretched by
    the profile's shared host CPU (paraflex/costs/host_cpu.py) as the served timeline and the
    requests open in `log_path` say."""
    logged = read_step_log(steps_dir)
    rows = [r for r in logged if start <= float(r["start_s"]) <= end and r["kind"] == "decode"]
    if not rows:
        return "no decode steps logged"
    stage_time = stage_time_fn(config.cluster.cost_model(), placement, {m.name: m.arch for m in config.models})
    host = host_cpu(config.cluster)
    # each step's stretch on the served timeline (every logged step's busy engines, the open requests)
    stretch = dict(zip(map(id, logged), step_stretches(logged, host, _rows(log_path) if log_path else [])))
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        if mine:
            served = float(np.mean([float(r["busy_s"]) for r in mine]))
            sim = float(np.mean([stage_time(r) * stretch[id(r)] for r in mine]))
            out.append(f"{model} {1000 * served:.2f} vs {1000 * sim:.2f} ms ({(sim - served) / served:+.0%})")
    shared = "" if host is None else " (stretched by the shared host CPU on the served timeline)"
    return f"decode stage step, served vs simulated for the same steps{shared}: " + "; ".join(out)


def served_parts(log_path: str, steps_dir: str, ids: set, start: float, end: float, profile: str) -> str:
    """The served TTFT in parts and the served hop of a window (bench/served_split.py) against
    the simulator's per-request delay and hop."""
    steps = [r for r in read_step_log(steps_dir) if start <= float(r["start_s"]) <= end]
    parts = ttft_parts([r for r in _rows(log_path) if r["id"] in ids], steps)
    text = "; ".join(f"{m} " + "/".join(f"{1000 * p[k]:.1f}" for k in PARTS) for m, p in parts.items())
    forward, tokens = handovers(steps)
    probed, served, back, term = measured_hop(profile), served_hop(profile), return_path(profile), gateway(profile)
    back_text = f"{1000 * back.latency_s:.1f} ms x the host's stretch" if back else "0 ms"
    before = f"{1000 * request_delay_s(profile):.1f} ms per request before the engines"
    if term is not None and term.quiet_delay_s is not None:  # stretched where the cluster is a shared host CPU
        before = (f"{1000 * term.engine_path_s:.1f} ms + the gateway's {1000 * term.quiet_delay_s:.1f} ms x the host's "
                  f"stretch per request before the engines")
    median = lambda gaps: f"{1000 * float(np.median([g for _, g in gaps])):.2f}" if gaps else "-"  # noqa: E731
    if served is not None:
        simulated = f"{1000 * served.latency_s:.2f} / {1000 * served.token_latency_s:.2f} ms simulated x the host's stretch"
    elif probed is not None:
        simulated = f"{1000 * probed.latency_s:.2f} ms (the probed hop) simulated"
    else:
        simulated = "the config's link simulated"
    return (f"served TTFT parts, median ms ({' / '.join(PARTS)}): {text}; simulated: "
            f"{before}, back {back_text}; served hop / token message back to an idle engine, median "
            f"{median(forward)} / {median(tokens)} ms over {len(forward)} / {len(tokens)} vs {simulated}")


def _rows(path: str) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))
