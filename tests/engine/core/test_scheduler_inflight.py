"""The in-flight bound on a pipeline's decode batches (`scheduler.decode_batches_in_flight`,
engine/policies/inflight_bound.py): a first stage holds an under-sized decode batch back while
the model has its bound of decode batches in flight, so returning requests merge."""

import pytest
from engine_core_harness import engine

from paraflex.engine.core.messages import TokenEntry, TokenMessage
from paraflex.engine.core.policies.inflight_bound import InflightLimit, parse_inflight_limit
from paraflex.errors import ConfigError


def _first_stage(limit, batch=4, stages=3):
    """Stage 0 of a `stages`-stage model M alone on an engine (its later stages elsewhere)."""
    s = engine(batch=batch, decode_batches_in_flight=limit)
    s.add_stage("M", 0, 1, 256, stages)
    return s


def _token_back(s, rid):
    """M's last stage sampled a token for `rid`: it arrives back at the first stage."""
    req = s.request(rid)
    s.receive_tokens(TokenMessage("M", "b", [TokenEntry(rid, None, req.context_len, False, None)]))


def _decode_batches_in_flight(s, n):
    """n requests, each prefilled and then sent off alone in its own decode batch."""
    for i in range(n):
        s.add_request(f"r{i}", "M", 4, 50, float(i))
        b = s.schedule()
        assert b.kind == "prefill"
        s.complete(b)
        _token_back(s, f"r{i}")
        b = s.schedule()
        assert b.kind == "decode" and b.req_ids == [f"r{i}"]
        s.complete(b)


def test_under_sized_batch_waits_while_the_pipeline_is_full_and_merges():
    s = _first_stage("stages")
    _decode_batches_in_flight(s, 3)  # 3 stages: 3 decode batches may fly
    assert len(s.stage_of("M").decode_inflight) == 3
    s.add_request("late", "M", 4, 50, 10.0)
    b = s.schedule()
    assert b.kind == "prefill"  # prompts are not held back
    s.complete(b)
    _token_back(s, "late")
    assert s.schedule() is None  # one ready request, three batches in flight: it waits
    _token_back(s, "r0")  # r0's batch comes back: the bound frees one slot
    b = s.schedule()
    assert b.req_ids == ["r0", "late"]  # they leave together


def test_the_paper_rule_sends_every_returning_group_alone():
    s = _first_stage("unbounded")
    _decode_batches_in_flight(s, 3)
    s.add_request("late", "M", 4, 50, 10.0)
    b = s.schedule()
    s.complete(b)
    _token_back(s, "late")
    assert s.schedule().req_ids == ["late"]  # a fourth batch of one


def test_a_full_batch_is_never_held_back():
    s = _first_stage("stages", batch=2)
    _decode_batches_in_flight(s, 3)
    for rid in ("x", "y"):
        s.add_request(rid, "M", 4, 50, 20.0)
        s.complete(s.schedule())
        _token_back(s, rid)
    assert s.schedule().req_ids == ["x", "y"]  # max_batch_size ready: runs beyond the bound


def test_one_stage_models_are_not_bounded():
    s = _first_stage(1, stages=1)
    s.add_request("a", "M", 4, 50, 0.0)
    s.add_request("b", "M", 4, 50, 1.0)
    assert s.schedule().kind == "prefill"


@pytest.mark.parametrize("value, cap", [("stages", 3), ("2x", 6), (5, 5), ("5", 5)])
def test_limit_values(value, cap):
    assert parse_inflight_limit(value).cap(3) == cap


@pytest.mark.parametrize("value", [0, -1, "zero", 1.5, True, "0x"])
def test_bad_limit_values_name_the_field(value):
    with pytest.raises(ConfigError, match="decode_batches_in_flight"):
        parse_inflight_limit(value)


def test_unbounded_spellings():
    assert parse_inflight_limit("unbounded") is None and parse_inflight_limit(None) is None
    assert parse_inflight_limit(InflightLimit(per_stage=2)).cap(2) == 4
