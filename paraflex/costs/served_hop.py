"""The served hop between engines as the shared host CPU stretches it, fitted from a served
run's engine step log.

Place in the data flow: `paraflex serve --step-log DIR` logs every engine step with its batch's
request ids (engine/step_log.py). `paraflex profile CONFIG --gateway-log FILE --step-log DIR`
calls `fit_served_hop`: from the steps whose receiving engine was idle when the batch was handed
over, the time from the end of a stage's step to the start of the next stage's step of the same
batch on another engine (a forward hop: phase-1 actor call, tensors over gloo, the idle loop
waking), and from the end of a last-stage step to the start of the first stage's next step of the
same requests (the token message back), each a latency stretched by the host's load at the
hand-over (paraflex/costs/host_cpu.py), least squares through the origin. It stores a
`ServedHopTerm` under ``served_hop`` in profile.json (paraflex/costs/serving_terms.py); the
simulator (simulator/core/cluster.py) charges a hop between engines of one node that latency x
a ratio drawn from its spread (latency_spread.py) x its own stretch, plus the bytes over the
measured bandwidth, and a token message the token latency the same way. `bench/served_split.py` prints the same samples per load window. Pure: rows are dicts.

Why: `bench/hop_latency.py`'s probe times a hop between two actors that do nothing else, ~1.0 ms
on the 2-vCPU machine, while the served hop to an idle engine took 1.6-2.6 ms and the token's way
back 1.3-2.2 ms in the same runs (docs/simulate.md, "The served hop"): a two-stage model pays
both on every token.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from paraflex.costs.host_cpu import HostCpu, fit_stretched_latency
from paraflex.costs.loop_fit import step_end
from paraflex.costs.serving_terms import ServedHopTerm


def _idle_since(steps: list[dict]) -> dict[int, float]:
    """id(step) -> when its engine's previous step ended (0: none before it)."""
    by_engine: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        by_engine[s["engine"]].append(s)
    out = {}
    for rows in by_engine.values():
        rows.sort(key=lambda s: float(s["start_s"]))
        prev_end = 0.0
        for s in rows:
            out[id(s)] = prev_end
            prev_end = step_end(s)
    return out


def handovers(steps: list[dict]) -> tuple[list[tuple[dict, float]], list[tuple[float, float]]]:
    """The hand-overs between engines of logged `steps` whose receiver was idle when the sender's
    step ended: (sending step, seconds to the receiver's step) of each forward hop (the next
    stage's first step with the same request ids), and (sender's end, seconds) of each token
    message back (the first stage's next step holding all of the last stage's requests)."""
    idle = _idle_since(steps)
    by_req: dict[tuple, list[dict]] = defaultdict(list)  # (model, stage, request id) -> its steps in time order
    for s in steps:
        for rid in (s.get("req_ids") or "").split():
            by_req[(s["model"], int(s["stage"]), rid)].append(s)
    for rows in by_req.values():
        rows.sort(key=lambda s: float(s["start_s"]))
    forward, tokens = [], []
    for s in steps:
        stage, last = int(s["stage"]), int(s["num_stages"]) - 1
        rids = (s.get("req_ids") or "").split()
        if last == 0 or not rids:
            continue
        end = step_end(s)
        to = 0 if stage == last else stage + 1
        nxt = next((p for p in by_req[(s["model"], to, rids[0])] if float(p["start_s"]) >= end), None)
        if nxt is None or nxt["engine"] == s["engine"] or idle[id(nxt)] > end:
            continue
        if stage < last and nxt["req_ids"] == s["req_ids"]:
            forward.append((s, float(nxt["start_s"]) - end))
        elif stage == last and set(rids) <= set(nxt["req_ids"].split()):
            tokens.append((end, float(nxt["start_s"]) - end))
    return forward, tokens


def fit_served_hop(steps: list[dict], requests: list[dict], host: HostCpu | None,
                   transfer_s: Callable[[dict], float]) -> ServedHopTerm | None:
    """The served hop of step log `steps` (with the run's request-log `requests`): each forward
    hop less `transfer_s(sending step)` (its bytes over the measured bandwidth) and each token
    message as a latency stretched by `host` (None: their means); None where the log has no
    hand-over between engines to an idle one (every model one stage, or the engines never idle)."""
    forward, tokens = handovers(steps)
    if not forward or not tokens:
        return None
    hops = [(step_end(s), max(0.0, gap - transfer_s(s))) for s, gap in forward]
    hop_s, hop_spread = fit_stretched_latency(hops, steps, requests, host)
    token_s, token_spread = fit_stretched_latency(tokens, steps, requests, host)
    return ServedHopTerm(hop_s, token_s, len(hops), len(tokens), hop_spread, token_spread)
