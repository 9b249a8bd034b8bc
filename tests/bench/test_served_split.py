"""bench/served_split.py: a served request's TTFT in parts from the request and step logs, and
the served hop where the receiving engine was idle (synthetic logs)."""

from __future__ import annotations

import pytest
from repo_paths import load_bench

from paraflex.costs.served_hop import handovers


def _step(engine, stage, kind, start, busy, ids):
    return {"engine": str(engine), "model": "m", "stage": str(stage), "num_stages": "2", "kind": kind, "start_s": str(start),
            "busy_s": str(busy), "req_ids": " ".join(ids)}


def test_ttft_parts_and_hops_follow_each_requests_own_steps():
    split = load_bench("served_split")
    steps = [_step(0, 0, "prefill", 10.010, 0.005, ["a"]),  # a's prefill, stage 0 on engine 0
             _step(1, 1, "decode", 10.012, 0.004, ["b"]),  # engine 1 busy with b until 10.016
             _step(1, 1, "prefill", 10.017, 0.004, ["a"]),  # a's stage 1: 2 ms after stage 0 ended
             _step(0, 0, "decode", 10.030, 0.002, ["a"]),
             _step(1, 1, "decode", 10.0335, 0.002, ["a"])]  # engine 1 idle since 10.021: a hop of 1.5 ms
    requests = [{"id": "a", "model": "m", "http_arrival_s": "10.000", "arrival_s": "10.002",
                 "first_token_s": "10.026"},
                {"id": "z", "model": "m", "http_arrival_s": "9", "arrival_s": "9", "first_token_s": "9.1"}]  # no steps
    parts = split.ttft_parts(requests, steps)["m"]
    assert parts["requests"] == 1
    assert [parts[p] for p in split.PARTS] == pytest.approx([0.002, 0.008, 0.011, 0.005])
    # the prefill hop waited for engine 1 (busy until 10.016): not a hop; the decode one counts
    forward, tokens = handovers(steps)
    assert [gap for _, gap in forward] == pytest.approx([0.0015])
    assert [gap for _, gap in tokens] == pytest.approx([0.009])  # a's prefill ended at 10.021, engine 0 next at 10.030
