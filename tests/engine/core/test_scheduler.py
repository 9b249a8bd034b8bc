"""Hand-checked scenarios for the scheduler rules of paper §5 (full-batch-first) and the protocol."""

import pytest
from engine_core_harness import deliver, engine, run

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.messages import BatchMessage, DecodeEntry, PrefillEntry
from paraflex.engine.core.request import (
    ABORTED,
    BLOCKED,
    FINISHED,
    RUNNING,
    SWAPPED_BLOCKED,
    SWAPPED_DECODE,
    WAITING_DECODE,
)
from paraflex.engine.core.scheduler import EngineScheduler, ProtocolError
from paraflex.errors import ConfigError, UserError


# ------------------------------------------------------------------ full-batch-first order
def test_prefills_one_request_per_batch_in_arrival_order_across_models():
    s = engine()
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    for rid, m, t in [("a1", "A", 0), ("a2", "A", 1), ("b1", "B", 2), ("a3", "A", 3), ("b2", "B", 4)]:
        s.add_request(rid, m, 8, 4, float(t))
    order = [run(s)[0].req_ids for _ in range(5)]
    assert order == [["a1"], ["a2"], ["b1"], ["a3"], ["b2"]]
    assert s.schedule() is None  # everyone waits for a token


def test_full_decode_then_prefill_then_undersized_decode():
    s = engine(batch=2)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    s.add_request("b1", "B", 8, 4, 0.0)  # oldest of all
    s.add_request("a1", "A", 8, 4, 1.0)
    s.add_request("a2", "A", 8, 4, 2.0)
    dones = [run(s)[1] for _ in range(3)]
    s.add_request("a3", "A", 8, 4, 3.0)
    for d in dones:
        deliver(s, d)
    # ready: A decodes [a1, a2] (full), prefill a3, B decode [b1] (under-sized, but oldest)
    b1, _ = run(s)
    b2, _ = run(s)
    b3, _ = run(s)
    assert (b1.kind, b1.req_ids) == ("decode", ["a1", "a2"])
    assert (b2.kind, b2.req_ids) == ("prefill", ["a3"])
    assert (b3.kind, b3.req_ids) == ("decode", ["b1"])


def test_undersized_decodes_go_oldest_first_across_models():
    s = engine(batch=8)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    s.add_request("a1", "A", 4, 4, 5.0)
    s.add_request("b1", "B", 4, 4, 1.0)
    dones = [run(s)[1] for _ in range(2)]
    for d in dones:
        deliver(s, d)
    assert run(s)[0].req_ids == ["b1"]
    assert run(s)[0].req_ids == ["a1"]


def test_prefill_packing_under_budget_when_configured():
    s = engine(batch=8, prefill_max_requests=3, prefill_token_budget=25)
    s.add_stage("A", 0, 1, 256, 1)
    for i in range(4):
        s.add_request(f"r{i}", "A", 10, 2, float(i))
    assert run(s)[0].req_ids == ["r0", "r1"]  # 30 tokens would exceed 25
    assert run(s)[0].req_ids == ["r2", "r3"]


def test_long_prompt_alone_may_exceed_budget():
    s = engine(prefill_token_budget=8)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("r", "A", 50, 2, 0.0)
    b, _ = run(s)
    assert b.req_ids == ["r"] and b.num_tokens == 50


# ------------------------------------------------------------------ pipeline protocol
def two_stage(batch=2, **kw):
    e0, e1 = engine(batch=batch, **kw), engine(batch=batch, **kw)
    e0.add_stage("M", 0, 2, 256, 2)
    e1.add_stage("M", 1, 3, 256, 2)
    return e0, e1


def prefill_through(e0, e1, arrivals):
    """Each (request id, arrival) of model M (4-token prompt, 5 new tokens) runs its prompt on
    both stages and has its first token back at the first: all wait to decode."""
    for rid, t in arrivals:
        e0.add_request(rid, "M", 4, 5, t)
        b, _ = run(e0)
        e1.receive_batch(b.message)
        _, d = run(e1)
        e0.receive_tokens(d.token_message)


def test_later_stage_runs_batch_as_formed_and_token_returns_to_first():
    e0, e1 = two_stage()
    e0.add_request("r1", "M", 6, 3, 0.0, prompt_token_ids=[1, 2, 3, 4, 5, 6], sampling={"temperature": 0.0})
    e0.add_request("r2", "M", 5, 3, 1.0)
    b, d = run(e0)
    assert b.requests[0].token_ids == [1, 2, 3, 4, 5, 6] and d.token_message is None
    assert [len(layer) for layer in b.requests[0].block_table] == [2, 2]  # 6 tokens / 4 per block, 2 layers
    e1.receive_batch(b.message)
    b1, d1 = run(e1, tokens={"r1": 77})
    assert b1.batch_id == b.batch_id and b1.req_ids == ["r1"] and b1.requests[0].sampling == {"temperature": 0.0}
    assert b1.message is None and b1.requests[0].samples
    (entry,) = d1.token_message.entries
    assert (entry.req_id, entry.token_id, entry.position, entry.finished) == ("r1", 77, 6, False)
    e0.receive_tokens(d1.token_message)
    assert e0.state_of("r1") == WAITING_DECODE and e1.state_of("r1") == BLOCKED
    # r2's prefill comes before r1's under-sized decode
    b2, _ = run(e0)
    assert b2.req_ids == ["r2"]
    e1.receive_batch(b2.message)
    _, d2 = run(e1, tokens={"r2": 5})
    e0.receive_tokens(d2.token_message)
    dec, _ = run(e0)
    assert dec.kind == "decode" and dec.req_ids == ["r1", "r2"]
    assert dec.requests[0].token_ids == [77] and dec.requests[0].start_pos == 6 and dec.requests[0].context_len == 7
    assert [(x.req_id, x.token_id, x.position) for x in dec.message.decodes] == [("r1", 77, 6), ("r2", None, 5)]  # r2 came without token ids (simulator style)
    e1.receive_batch(dec.message)
    decb, _ = run(e1)
    assert decb.batch_id == dec.batch_id and decb.req_ids == ["r1", "r2"] and decb.total_context == 7 + 6


def test_later_stage_prefers_full_decode_batch_over_older_prefill():
    e0, e1 = two_stage(batch=2)
    prefill_through(e0, e1, [("r1", 1.0), ("r2", 2.0)])
    full, _ = run(e0)
    assert full.req_ids == ["r1", "r2"]
    old = BatchMessage("M", 1, "x", "prefill", [PrefillEntry("p", 0, 4, 4, 5, 0.0)])  # arrived first
    e1.receive_batch(old)
    e1.receive_batch(full.message)
    assert run(e1)[0].req_ids == ["r1", "r2"]
    assert run(e1)[0].req_ids == ["p"]


def test_finish_by_length_and_by_stop_frees_everywhere():
    e0, e1 = two_stage()
    e0.add_request("a", "M", 4, 1, 0.0)  # one token: done after prefill
    e0.add_request("b", "M", 4, 9, 1.0)
    for _ in range(2):
        b, _ = run(e0)
        e1.receive_batch(b.message)
    _, d = run(e1, tokens={"a": 3})
    assert d.finished == ["a"] and d.token_message.entries[0].reason == "length"
    assert e1.state_of("a") == FINISHED and e1.pool.get("a") is None
    e0.handle(d.free_message("M"))  # free may reach the first stage before the token
    e0.receive_tokens(d.token_message)  # ... and the late token is ignored
    assert e0.state_of("a") == FINISHED and e0.pool.num_used == 2 * 1 * 2 - 2  # only b's 2 blocks (1 per layer)
    _, d = run(e1, tokens={"b": 9}, stopped={"b"})
    assert d.token_message.entries[0].reason == "stop" and d.finished == ["b"]
    e0.receive_tokens(d.token_message)
    assert e0.state_of("b") == FINISHED and e0.pool.num_used == 0 and e1.pool.num_used == 0
    assert e0.free("b") is False  # idempotent


def test_single_stage_model_finishes_after_max_new_tokens():
    s = engine()
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("r", "A", 3, 3, 0.0)
    kinds = []
    while s.state_of("r") != FINISHED:
        b, d = run(s)
        kinds.append(b.kind)
        s.receive_tokens(d.token_message)
    assert kinds == ["prefill", "decode", "decode"]
    assert s.pool.num_used == 0


# ------------------------------------------------------------------ swapping
def four_tokens_per_block(blocks, host=100):
    s = engine(blocks=blocks, host=host, batch=4)
    for m in ("A", "B", "C"):
        s.add_stage(m, 0, 1, 256, 1)
    return s


def prefill_all(s, reqs, max_new=10):
    """reqs: (id, model, prompt, arrival); runs their prefills, returns completions by id."""
    for rid, m, p, t in reqs:
        s.add_request(rid, m, p, max_new, t)
    dones = {}
    for _ in reqs:
        b, d = run(s)
        dones[b.req_ids[0]] = d
    return dones


def test_victims_come_from_the_model_with_most_kv_blocked_first_newest_first():
    s = four_tokens_per_block(blocks=10)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2), ("b1", "B", 4, 3), ("c1", "C", 4, 4)])
    assert s.pool.num_used == 8
    deliver(s, dones["a1"])  # a1 waiting-decode; a2, a3 blocked
    deliver(s, dones["a2"])
    deliver(s, dones["c1"])
    s.add_request("x", "B", 4, 20, 9.0)
    # no full decode batch (A has 2 ready < 4): the prefill x goes before the under-sized decodes
    b, _ = run(s)
    assert b.req_ids == ["x"] and not b.swap_out
    # now 1 free block; A's decode [a1, a2] needs 2 more blocks -> evict 1 block's worth
    b, _ = run(s)
    assert b.req_ids == ["a1", "a2"]
    # A holds 6 blocks (B 2, C 1): A's blocked a3 goes, although B's blocked x and b1 are newer
    assert s.state_of("a3") == SWAPPED_BLOCKED
    assert len(b.swap_out) == 2 and b.swap_out_bytes == 2 * 1024
    s.check()


def test_within_a_model_blocked_before_waiting_decode_newest_first():
    s = four_tokens_per_block(blocks=9)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2), ("a4", "A", 8, 3), ("c1", "C", 4, 4)])
    assert s.pool.num_free == 0
    deliver(s, dones["a4"])  # a4 newest, waiting-decode: evicted last
    deliver(s, dones["c1"])
    # under-sized decodes by arrival: a4 (3) before c1 (4); a4 needs a block, the pool is full:
    # victim model A (8 blocks vs C's 1), blocked a1..a3 before waiting-decode, newest first -> a3
    b, _ = run(s)
    assert b.req_ids == ["a4"]
    assert s.state_of("a3") == SWAPPED_BLOCKED and s.state_of("a2") == BLOCKED
    b, _ = run(s)
    assert b.req_ids == ["c1"] and not b.swap_out  # a3's 2 blocks covered both
    s.check()


def test_swapped_request_comes_back_intact_and_no_admission_meanwhile():
    s = four_tokens_per_block(blocks=6)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2)])
    deliver(s, dones["a1"])
    b, d1 = run(s)  # a1 grows to 9 tokens: 3 blocks -> evicts a3 (blocked, newest)
    assert b.req_ids == ["a1"] and s.state_of("a3") == SWAPPED_BLOCKED
    s.add_request("n", "B", 4, 20, 5.0)
    deliver(s, dones["a3"])  # token arrives while swapped
    assert s.state_of("a3") == SWAPPED_DECODE
    # a free block exists (6 - 3 - 2 = 1) but nothing is admitted while a request is swapped out
    b, _ = run(s)
    assert b.req_ids == ["a3"] and s.state_of("n") == "waiting-prefill"
    assert len(b.swap_in) == 2 and b.requests[0].start_pos == 8 and b.requests[0].context_len == 9  # no recompute
    back = {dst for _, dst in b.swap_in}
    assert back <= {blk for layer in b.requests[0].block_table for blk in layer}
    assert s.state_of("a2") == SWAPPED_BLOCKED  # a3 needed room: a2 (blocked) went out
    s.check()


def test_swap_in_oldest_first_when_space_frees():
    s = engine(blocks=6, host=100, batch=1)
    s.add_stage("A", 0, 1, 256, 1)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2)])
    d = dones["a1"]
    while s.state_of("a2") != SWAPPED_BLOCKED:  # a1 keeps growing: a3, then a2 go out
        deliver(s, d)
        _, d = run(s)
    assert s.state_of("a3") == SWAPPED_BLOCKED and s.pool.host_num_used == 4
    s.free("a1")  # space frees
    deliver(s, dones["a3"])  # a3 becomes ready first ...
    deliver(s, dones["a2"])
    b, _ = run(s)
    assert b.req_ids == ["a2"] and not b.swap_out  # ... but a2 is older
    # a2 comes in for its batch; the freed space brings a3 back too, after it
    a2_blocks = {x for layer in s.pool.get("a2").table for x in layer}
    a3_blocks = {x for layer in s.pool.get("a3").table for x in layer}
    assert {d for _, d in b.swap_in[:2]} <= a2_blocks and {d for _, d in b.swap_in[2:]} == a3_blocks
    assert s.state_of("a3") == WAITING_DECODE and s.pool.host_num_used == 0
    b, _ = run(s)
    assert b.req_ids == ["a3"] and not b.swap_in
    s.check()


def test_swapped_blocked_requests_return_ahead_of_need_oldest_first():
    s = engine(blocks=6, host=100, batch=1)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2)])
    d = dones["a1"]
    while s.state_of("a2") != SWAPPED_BLOCKED:
        deliver(s, d)
        _, d = run(s)
    s.free("a1")
    s.add_request("b", "B", 4, 2, 9.0)
    # b is admitted (the swapped requests' 4 blocks stay reserved) and its batch carries
    # the swap-ins of the blocked requests, oldest first
    b, _ = run(s)
    assert b.req_ids == ["b"] and not b.swap_out
    a2_blocks = [x for layer in s.pool.get("a2").table for x in layer]
    a3_blocks = [x for layer in s.pool.get("a3").table for x in layer]
    assert [dst for _, dst in b.swap_in] == a2_blocks + a3_blocks
    assert s.state_of("a2") == BLOCKED and s.state_of("a3") == BLOCKED
    s.check()


def test_admission_keeps_room_for_swapped_requests():
    s = engine(blocks=6, host=100, batch=1)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2)])
    d = dones["a1"]
    while s.state_of("a2") != SWAPPED_BLOCKED:
        deliver(s, d)
        _, d = run(s)
    # a1 holds 5 blocks (17 tokens), 1 free, a2 + a3 hold 4 host blocks
    s.add_request("b", "B", 4, 2, 9.0)
    assert s.pool.num_free == 1 and s.schedule() is None  # b fits the free block, but that is reserved


def test_eviction_is_all_or_nothing():
    s = four_tokens_per_block(blocks=4, host=1)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("b1", "B", 8, 1)], max_new=4)
    deliver(s, dones["a1"])
    deliver(s, dones["b1"])
    # a1 needs 1 block; only victim b1 (2 blocks, waiting-decode) does not fit the 1-block host
    assert s.schedule() is None
    assert s.state_of("a1") == WAITING_DECODE and s.state_of("b1") == WAITING_DECODE and s.pool.host_num_used == 0


def test_decode_batch_shrinks_to_what_fits():
    s = four_tokens_per_block(blocks=10, host=0)  # no host pool: nothing can be evicted
    dones = prefill_all(s, [("a1", "A", 4, 0), ("a2", "A", 4, 1), ("a3", "A", 4, 2), ("a4", "A", 4, 3),
                            ("b1", "B", 16, 4)], max_new=4)
    for rid in ("a1", "a2", "a3", "a4"):
        deliver(s, dones[rid])
    assert s.pool.num_free == 2  # each decode needs a second block: only 2 of 4 fit
    b, _ = run(s)
    assert b.req_ids == ["a1", "a2"] and not b.swap_out
    assert s.state_of("a3") == WAITING_DECODE and s.state_of("a4") == WAITING_DECODE
    assert s.schedule() is None


# ------------------------------------------------------------------ aborts
def test_abort_waiting_and_running_and_unknown():
    s = engine()
    s.add_stage("A", 0, 1, 256, 1)
    s.add_request("w", "A", 4, 3, 0.0)
    s.add_request("r", "A", 4, 3, 1.0)
    assert s.abort("w") and s.state_of("w") == ABORTED
    b = s.schedule()
    assert b.req_ids == ["r"] and s.state_of("r") == RUNNING
    assert s.abort("r") and s.state_of("r") == RUNNING  # waits for the batch
    d = s.complete(b)
    assert d.aborted == ["r"] and d.token_message.entries == [] and s.state_of("r") == ABORTED
    assert s.pool.num_used == 0 and s.num_live == 0
    assert s.abort("ghost") is False and s.state_of("ghost") == ABORTED


def test_abort_inside_a_received_batch_drops_its_rows():
    e0, e1 = two_stage(batch=3)
    prefill_through(e0, e1, [("x", 0.0), ("y", 1.0), ("z", 2.0)])
    dec, _ = run(e0)
    assert dec.req_ids == ["x", "y", "z"]
    e1.abort("late")  # unknown yet: remembered
    e1.receive_batch(dec.message)
    e1.abort("y")
    b, _ = run(e1)
    assert b.req_ids == ["x", "z"] and b.src_rows == [(0, 1), (2, 3)]
    e1.receive_batch(BatchMessage("M", 1, "q", "prefill", [PrefillEntry("late", 0, 4, 4, 2, 3.0)]))
    assert e1.request("late") is None and e1.schedule() is None


def test_a_received_batch_holding_a_request_already_ended_here_drops_its_rows():
    """The abort reached the later stage before the batch the first stage formed with the
    request: the batch runs without it and says which received rows to keep (else the worker
    would run every received row against fewer requests: a native decode read past its
    buffers, a crashed engine)."""
    e0, e1 = two_stage(batch=3)
    prefill_through(e0, e1, [("x", 0.0), ("y", 1.0), ("z", 2.0)])
    dec, _ = run(e0)
    e1.abort("y")  # freed here first
    e1.receive_batch(dec.message)
    b, _ = run(e1)
    assert b.req_ids == ["x", "z"] and b.src_rows == [(0, 1), (2, 3)]


# ------------------------------------------------------------------ protocol errors
def test_protocol_errors_are_clear():
    e0, e1 = two_stage()
    with pytest.raises(ProtocolError, match="no first stage"):
        e1.add_request("r", "M", 4, 4, 0.0)
    e0.add_request("r", "M", 4, 4, 0.0)
    with pytest.raises(ProtocolError, match="already used"):
        e0.add_request("r", "M", 4, 4, 0.0)
    with pytest.raises(ConfigError, match="prompt_len"):
        e0.add_request("q", "M", 0, 4, 0.0)
    with pytest.raises(ProtocolError, match="unknown request"):
        e1.receive_batch(BatchMessage("M", 1, "b", "decode", decodes=[DecodeEntry("nope", 1, 4)]))
    b = e0.schedule()
    with pytest.raises(ProtocolError, match="while its batch runs"):
        e0.free("r")
    with pytest.raises(ConfigError, match="at most one stage"):
        e0.add_stage("M", 1, 2, 256, 2)
    with pytest.raises(ConfigError, match="scheduler.policy"):
        engine(policy="fastest")
    assert b is not None


def test_request_that_can_never_fit_is_refused_up_front():
    s = engine(blocks=10, host=100)
    s.add_stage("A", 0, 2, 256, 1)  # 4 tokens per block, 2 layers: 20 tokens max
    s.add_request("ok", "A", 12, 9, 0.0)  # 20 tokens of KV at most
    with pytest.raises(UserError, match="lower max_tokens"):
        s.add_request("huge", "A", 12, 10, 0.0)


def test_later_stage_batch_larger_than_the_pool_fails_loudly():
    e1 = engine(blocks=4)
    e1.add_stage("M", 1, 1, 256, 2)
    e1.receive_batch(BatchMessage("M", 1, "b", "prefill", [PrefillEntry("p", 0, 40, 40, 2, 0.0)]))
    with pytest.raises(ProtocolError, match="needs 10 KV blocks, the pool holds 4"):
        e1.schedule()


def test_swap_in_ahead_keeps_the_headroom_free():
    s = engine(blocks=59, host=100, batch=1)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    assert s.kv.headroom_blocks == 5  # 10% of the pool
    dones = prefill_all(s, [("a1", "A", 4 * 20, 0), ("a2", "A", 4 * 20, 1), ("a3", "A", 4 * 19, 2)])
    deliver(s, dones["a3"])
    b, _ = run(s)  # the pool is full; a3 grows by a block: evicts a2 (A's newest blocked)
    assert s.state_of("a2") == SWAPPED_BLOCKED and s.pool.num_free == 19
    s.add_request("b", "B", 4 * 8, 2, 9.0)  # 8 blocks; 19 free but a2's 20 are reserved
    assert s.schedule() is None
    s.free("a1")  # 20 more free: 39
    b, _ = run(s)  # b admitted (39 - 20 reserved >= 8); 31 left: a2 (20) comes back, 11 >= 5 stay free
    assert b.req_ids == ["b"] and len(b.swap_in) == 20 and s.state_of("a2") == BLOCKED
    assert s.pool.num_free == 11


def test_from_config_reads_the_scheduler_section():
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_batch_size=7, block_bytes=1024, policy="prefill-first", prefill_token_budget=99)
    s = EngineScheduler.from_config(BlockPool(10, 1024), cfg, engine_id=3)
    assert (s.max_batch_size, s.policy.name, s.prefill_token_budget, s.engine_id) == (7, "prefill-first", 99, 3)
    assert s.prefill_max_requests == 7  # prefill-first packs prompts by default


def test_an_older_blocked_request_goes_before_a_newer_waiting_one():
    s = engine(blocks=6, host=100, batch=1)
    s.add_stage("A", 0, 1, 256, 1)
    dones = prefill_all(s, [("a1", "A", 8, 0), ("a2", "A", 8, 1), ("a3", "A", 8, 2)])
    deliver(s, dones["a2"])
    deliver(s, dones["a3"])
    b, _ = run(s)  # batch of one: a2 needs a third block in a full pool
    assert b.req_ids == ["a2"]
    assert s.state_of("a1") == SWAPPED_BLOCKED  # blocked a1 (oldest) rather than waiting a3 (newest)
    assert s.state_of("a3") == WAITING_DECODE
