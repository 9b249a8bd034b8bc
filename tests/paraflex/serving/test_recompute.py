"""Preemption by recompute (paraflex/serving/recompute.py), as pure logic: the cap on restarts, when a
held request goes back to its replica, and what it is restarted with."""

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.recompute import MAX_RECOMPUTES, Restartable, Restarts, preempt, restart, to_release


def _rec(model="m", replica=0, output=(), held=False, max_tokens=10):
    return Restartable(model=model, replica=replica, prompt=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens),
                       engine_rid="x", output=list(output), held=held)


def test_a_request_is_held_until_the_cap_then_ended():
    rec = _rec(output=[7])
    for n in range(1, MAX_RECOMPUTES + 1):
        assert preempt(rec) and rec.held and rec.recomputes == n
        rec.held = False
    assert not preempt(rec) and not rec.held


def test_the_oldest_held_request_goes_back_after_an_end_or_when_its_replica_runs_nothing():
    live = [("a", _rec()), ("b", _rec(held=True)), ("c", _rec(held=True)), ("d", _rec(replica=1, held=True))]
    assert to_release(live, ("m", 0), ended=False) is None  # "a" still runs: wait for an end
    assert to_release(live, ("m", 0), ended=True) == "b"
    assert to_release(live, ("m", 1), ended=False) == "d"  # nothing of replica 1 runs
    assert to_release(live[:1], ("m", 0), ended=True) is None  # nothing held


def test_a_restart_continues_from_the_tokens_received_under_a_fresh_engine_id():
    rec = _rec(output=[7, 8], max_tokens=10)
    preempt(rec)
    prompt, params = restart("r", rec, lambda rid: rid == "r#recompute1")
    assert prompt == [1, 2, 3, 7, 8]
    assert (params.max_tokens, params.resumed) == (8, [7, 8])
    assert rec.params.max_tokens == 10 and rec.params.resumed == []  # the client's params stay whole
    assert rec.engine_rid == "r#recompute2" and not rec.held
    assert (rec.tokens, rec.run_tokens) == (2, 0)  # no KV until the new run's first token
    rec.output.append(9)
    assert rec.run_tokens == 1
    preempt(rec)
    prompt, params = restart("r", rec, lambda rid: False)
    assert rec.engine_rid == "r#recompute3"  # ids only grow: the engines remember freed ones
    assert prompt == [1, 2, 3, 7, 8, 9] and (params.max_tokens, params.resumed) == (7, [7, 8, 9])


def test_the_books_map_each_run_to_its_client_request_and_count_the_stops():
    books = Restarts()
    live = {"a": _rec(output=[7]), "b": _rec(output=[8])}
    for rid, rec in live.items():
        rec.engine_rid = rid
        books.begin(rid)
    assert books.stop(live["b"]) and books.client_of == {"a": "a"}  # b's run: its outputs are dropped
    assert books.preemptions == {"m": 1} and books.in_use("b", live)
    assert books.release(live, ("m", 0), ended=False) is None  # "a" still runs
    rid, prompt, params = books.release(live, ("m", 0), ended=True)
    assert rid == "b" and books.client_of == {"a": "a", "b#recompute1": "b"} and prompt == [1, 2, 3, 8]
    books.end(live.pop("b"))
    assert books.client_of == {"a": "a"}

