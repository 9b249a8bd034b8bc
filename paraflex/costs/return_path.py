"""The served return path of a token as the shared host CPU stretches it, fitted from a served
run's step log and request log together.

Place in the data flow: `paraflex serve --step-log DIR --request-log FILE` logs every engine
step with the request ids of its batch (engine/step_log.py) and every request's first-token and
finish time at the frontend (paraflex/serving/request_log.py). `paraflex profile CONFIG
--gateway-log FILE --step-log DIR` calls `fit_return_path`: per logged request, the way back of
its first token (end of its last-stage prefill step -> first token at the frontend) and of its
last (end of its last step -> finish), against the host's stretch over the engines busy in the
window before that step ended and the requests in flight then (paraflex/costs/host_cpu.py, fitted from the same step log); a
least-squares latency and the samples' spread around it give a `ReturnPathTerm` (paraflex/costs/serving_terms.py, `return_path` in
profile.json). The simulator measures the same busy engines over the same window from its own
engine timeline (simulator/core/cluster.py) and records each token `latency_s` x a ratio drawn
from the spread x that stretch later. Pure: rows are dicts.

Why the host's stretch: on the 2-vCPU machine the way back of a token was ~4 ms while at most
one engine was executing and 8-13 ms while both were (the output push, the OutputRouter actor
and the gateway's poller thread wait for a core the engines hold); a latency stretched by the
one shared-CPU term fits the logged tokens as well as the separate line in the busy engines
that it replaces (docs/simulate.md, "The shared host CPU").
"""

from __future__ import annotations

from collections import defaultdict

from paraflex.costs.host_cpu import HostCpu, fit_stretched_latency
from paraflex.costs.loop_fit import step_end
from paraflex.costs.serving_terms import ReturnPathTerm


def token_backs(requests: list[dict], steps: list[dict]) -> list[tuple[float, float]]:
    """(step end, way back in seconds) of the first and the last token of every request in
    `requests` (request-log rows) whose last-stage steps are in `steps`."""
    last_stage: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for s in steps:
        if int(s["stage"]) == int(s["num_stages"]) - 1:
            for rid in (s.get("req_ids") or "").split():
                last_stage[rid].append((step_end(s), s["kind"]))
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


def fit_return_path(requests: list[dict], steps: list[dict], host: HostCpu | None = None) -> ReturnPathTerm | None:
    """The way back as `latency_s` x the host's stretch over the busy engines before each token
    (least squares through the origin; `host` None: the mean way back); None where no request of
    `requests` has its steps in `steps`."""
    backs = token_backs(requests, steps)
    if not backs:
        return None
    latency, spread = fit_stretched_latency(backs, steps, requests, host)
    return ReturnPathTerm(latency, len(backs), spread)
