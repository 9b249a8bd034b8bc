"""The other policies: prefill-first (vLLM-like), sarathi (chunked prefill, micro-batch limit) and
pipeline-first (a multi-stage model's decode batches ahead)."""

from engine_core_harness import Cluster, ModelSpec, deliver, engine, run

import pytest

from paraflex.engine.core.messages import BatchMessage, DecodeEntry, PrefillEntry, TokenEntry, TokenMessage
from paraflex.engine.core.policies import POLICIES, get_policy
from paraflex.engine.core.request import BLOCKED, WAITING_PREFILL


def test_registry_names():
    assert sorted(POLICIES) == ["full-batch-first", "pipeline-first", "prefill-first", "sarathi"]
    assert get_policy("sarathi").name == "sarathi"


def _stage0_with_a_returning_token(policy):
    """Stage 0 of a 2-stage model M beside a one-stage model A: M's request `m` has its token
    back (an under-sized decode group, nothing in flight), A's prompt `a` arrived before it."""
    s = engine(batch=4, policy=policy)
    s.add_stage("M", 0, 1, 256, 2)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("m", "M", 4, 8, 0.0)
    run(s)
    s.receive_tokens(TokenMessage("M", "b", [TokenEntry("m", None, 4, False, None)]))
    s.add_request("a", "A", 4, 8, 1.0)
    return s


def _stage1_with_a_received_decode(policy):
    """Stage 1 (of 2) of M holding a received decode batch of one, and A's prompt."""
    s = engine(batch=4, policy=policy)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("M", 1, 1, 256, 2)
    s.receive_batch(BatchMessage("M", 1, "p", "prefill", [PrefillEntry("m", 0, 4, 4, 8, 0.0)]))
    run(s)
    s.add_request("a", "A", 4, 8, 1.0)
    s.receive_batch(BatchMessage("M", 1, "d", "decode", decodes=[DecodeEntry("m", None, 4)]))
    return s


@pytest.mark.parametrize("policy, first", [("full-batch-first", "a"), ("pipeline-first", "m")])
def test_pipeline_first_runs_a_multi_stage_decode_before_another_model_prompt(policy, first):
    """full-batch-first (the paper's order) runs A's prompt before M's under-sized decode group,
    pipeline-first the reverse; at a first stage and at a later stage alike."""
    assert run(_stage0_with_a_returning_token(policy))[0].req_ids[0] == first
    assert run(_stage1_with_a_received_decode(policy))[0].req_ids[0] == first


def test_prefill_first_packs_prompts_and_runs_them_before_full_decodes():
    s = engine(batch=2, policy="prefill-first", prefill_token_budget=20)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("a1", "A", 8, 4, 0.0)
    s.add_request("a2", "A", 8, 4, 1.0)
    b, d = run(s)
    assert b.req_ids == ["a1", "a2"]  # packed: 16 tokens <= 20, 2 <= max_batch_size
    deliver(s, d)
    s.add_request("a3", "A", 8, 4, 2.0)
    assert run(s)[0].req_ids == ["a3"]  # prefill before the full decode batch [a1, a2]
    assert run(s)[0].req_ids == ["a1", "a2"]


def test_sarathi_chunks_prompts_and_mixes_decodes():
    s = engine(batch=4, policy="sarathi", prefill_token_budget=6)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("long", "A", 14, 3, 0.0)
    s.add_request("short", "A", 3, 3, 1.0)
    b1, _ = run(s)
    assert b1.kind == "prefill" and [(r.req_id, r.start_pos, r.num_tokens, r.samples) for r in b1.requests] == [("long", 0, 6, False)]
    assert s.state_of("long") == WAITING_PREFILL
    b2, _ = run(s)
    assert [(r.req_id, r.start_pos, r.num_tokens) for r in b2.requests] == [("long", 6, 6)]
    b3, d3 = run(s)  # the last 2 tokens of long and all 3 of short fit the budget of 6
    assert [(r.req_id, r.start_pos, r.num_tokens, r.samples) for r in b3.requests] == [("long", 12, 2, True), ("short", 0, 3, True)]
    assert b3.num_tokens <= 6 and s.state_of("long") == BLOCKED
    s.add_request("new", "A", 20, 3, 5.0)
    assert s.schedule() is None  # a one-stage model: one micro-batch in flight, b3 awaits its tokens
    deliver(s, d3)
    b4, _ = run(s)
    assert b4.kind == "mixed"  # decodes first in line, a chunk of `new` fills the rest of the budget
    assert [(r.req_id, r.kind, r.num_tokens) for r in b4.requests] == [("new", "prefill", 4), ("long", "decode", 1), ("short", "decode", 1)]


def test_sarathi_limits_micro_batches_in_flight_to_stage_count():
    c = Cluster(3, [ModelSpec("M", [0, 1, 2], [1, 1, 1])], blocks=500, max_batch_size=1, policy="sarathi",
                sched_kwargs={"prefill_token_budget": 4})
    first = c.engines[0]
    for i in range(6):
        c.add(f"r{i}", "M", 4, 3)
    c.deliver()
    formed = 0
    while c.step_engine(0):  # no message delivered meanwhile: no token comes back
        formed += 1
    assert formed == 3 and len(first.stage_of("M").inflight) == 3  # 3 stages -> at most 3 micro-batches in flight
    c.run()
    assert c.finished == {f"r{i}" for i in range(6)}


def test_sarathi_chunks_flow_through_later_stages_in_order():
    c = Cluster(2, [ModelSpec("M", [0, 1], [2, 2])], blocks=500, max_batch_size=4, policy="sarathi",
                sched_kwargs={"prefill_token_budget": 5})
    c.add("r", "M", 17, 4)
    c.run()
    assert c.finished == {"r"} and c.tokens["r"] == 4
    later = [b for e, b in c.batches if e == 1 and b.kind != "decode"]
    assert [(b.requests[0].start_pos, b.requests[0].num_tokens) for b in later] == [(0, 5), (5, 5), (10, 5), (15, 2)]


def test_abort_removes_a_request_from_every_pending_chunk_batch():
    c = Cluster(2, [ModelSpec("M", [0, 1], [1, 1])], blocks=500, max_batch_size=4, policy="sarathi",
                sched_kwargs={"prefill_token_budget": 5})
    c.add("r", "M", 12, 3)
    c.add("q", "M", 2, 2)
    c.deliver()
    while c.step_engine(0):  # chunks 0-5, 5-10, then 10-12 with all of q reach engine 1 unrun
        pass
    c.deliver()
    later = c.engines[1]
    assert later.request("r").pending_chunks == 3
    c.abort("r")
    c.deliver()
    b = later.schedule(c.now)
    assert b.req_ids == ["q"] and b.src_rows == [(2, 4)]  # r's 2 rows of that batch are dropped
    assert later.schedule(c.now) is None  # r's chunk-only batches are gone
    later.complete(b)
    later.check()
