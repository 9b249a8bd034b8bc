"""The served hop (paraflex/costs/served_hop.py): which logged hand-overs between engines count
(the receiver idle, the same batch on the next stage, the first stage's next step of the last
stage's requests), and the fit that takes the bytes off and stretches the rest."""

import pytest

from paraflex.costs.host_cpu import HostCpu
from paraflex.costs.served_hop import fit_served_hop, handovers


def _step(engine, stage, kind, start, busy, ids, model="m", stages=2, tokens=0):
    return {"engine": str(engine), "model": model, "stage": str(stage), "num_stages": str(stages), "kind": kind,
            "batch_size": str(len(ids.split())), "prefill_tokens": str(tokens), "start_s": f"{start:.6f}",
            "busy_s": f"{busy:.6f}", "req_ids": ids}


def _token_cycle(t0, ids="r1"):
    """Stage 0 on engine 0, stage 1 on engine 1: a prefill, then a decode token; hops of 2 ms, token back 3 ms."""
    return [_step(0, 0, "prefill", t0, 0.010, ids, tokens=16), _step(1, 1, "prefill", t0 + 0.012, 0.010, ids, tokens=16),
            _step(0, 0, "decode", t0 + 0.025, 0.004, ids), _step(1, 1, "decode", t0 + 0.031, 0.004, ids)]


def test_the_hops_to_an_idle_engine_and_the_token_messages_back_are_found():
    forward, tokens = handovers(_token_cycle(1.0) + _token_cycle(2.0, "r2"))
    assert sorted(round(gap, 6) for _, gap in forward) == [0.002] * 4
    assert [round(gap, 6) for _, gap in tokens] == [0.003, 0.003]  # after each prefill; the last decode has no next step


def test_a_receiver_busy_when_the_batch_was_handed_over_is_left_out():
    steps = _token_cycle(1.0)
    steps.append(_step(1, 0, "prefill", 1.0095, 0.0025, "x", model="other", stages=1))  # engine 1 busy until 1.012
    forward, _ = handovers(steps)
    assert [round(gap, 6) for _, gap in forward] == [0.002]  # the decode hop only


def test_one_stage_models_have_no_hand_over():
    steps = [_step(0, 0, "prefill", 1.0, 0.01, "r1", stages=1), _step(0, 0, "decode", 1.02, 0.004, "r1", stages=1)]
    assert handovers(steps) == ([], [])
    assert fit_served_hop(steps, [], None, lambda s: 0.0) is None


def test_the_fit_takes_the_bytes_off_and_the_hosts_stretch_out():
    steps = _token_cycle(1.0) + _token_cycle(2.0, "r2")
    bytes_s = lambda s: 0.001 if s["kind"] == "prefill" else 0.0  # noqa: E731  (the prefill's hidden state: 1 ms on the wire)
    term = fit_served_hop(steps, [], None, bytes_s)
    assert term.latency_s == pytest.approx(0.0015) and term.token_latency_s == pytest.approx(0.003)
    assert (term.hops, term.tokens) == (4, 2)
    assert term.hop_spread[0] == pytest.approx(1 / 1.5) and term.hop_spread[-1] == pytest.approx(2 / 1.5)
    steps.append(_step(2, 0, "decode", 0.5, 3.0, "z", model="other", stages=1))  # a third engine busy throughout
    busy = fit_served_hop(steps, [], HostCpu(cores=1, demand_per_engine=1.0), lambda s: 0.0)
    assert busy.latency_s < 0.0015 and busy.token_latency_s < 0.0025  # part of each is the stretch
