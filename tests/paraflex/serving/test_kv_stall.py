"""The KV-stall watch (paraflex/serving/kv_stall.py) with made-up batch counts and a made-up clock:
which replica counts as stalled, which request it ends, and what never counts as a stall (a
batch under way, stale numbers, arrivals, another replica's work)."""

from __future__ import annotations

from paraflex.serving.kv_stall import LiveRequest, StallWatch

A, B = ("a", 0), ("b", 0)


def _live(*tokens):
    return [LiveRequest(f"r{i}", t) for i, t in enumerate(tokens)]


def _runs(a=(3, 3), b=(5, 5), fresh=True):
    """Engine 0 holds model a, engine 1 model b."""
    return {0: {"a": a} if fresh else None, 1: {"b": b}}


def test_a_replica_without_progress_loses_its_newest_request_with_tokens_then_waits_again():
    w = StallWatch(after_s=5)
    reps = {A: ([0], _live(7, 4, 0))}
    assert w.check(0.0, _runs(), reps) == [] and w.check(4.9, _runs(), reps) == []
    ends = w.check(5.0, _runs(), reps)
    assert [rid for rid, _ in ends] == ["r1"]  # r2 has no tokens: it holds no KV
    assert ends[0][1].startswith("stopped to free KV memory: no batch of a ran on its engines for 5 s while 3")
    assert w.check(9.9, _runs(), reps) == [] and [r for r, _ in w.check(10.0, _runs(), reps)] == ["r1"]


def test_progress_resets_the_clock_arrivals_do_not():
    w = StallWatch(after_s=5)
    w.check(0.0, _runs(), {A: ([0], _live(7, 4))})
    assert w.check(4.0, _runs(a=(4, 4)), {A: ([0], _live(7, 4))}) == []  # a batch of a ran
    assert w.check(8.0, _runs(a=(4, 4)), {A: ([0], _live(7, 5))}) == []  # a token arrived
    assert w.check(12.9, _runs(a=(4, 4)), {A: ([0], _live(7, 5, 0, 0))}) == []  # two arrivals
    assert [r for r, _ in w.check(13.0, _runs(a=(4, 4)), {A: ([0], _live(7, 5, 0, 0))})] == ["r1"]


def test_a_batch_under_way_or_stale_numbers_are_never_a_stall():
    w = StallWatch(after_s=5)
    reps = {A: ([0], _live(7))}
    for t in range(0, 60, 5):  # a 60 s batch of model a: started 4, finished 3
        assert w.check(float(t), _runs(a=(4, 3)), reps) == []
    w = StallWatch(after_s=5)
    busy_neighbour = {0: {"a": (3, 3), "b": (9, 8)}, 1: {"b": (5, 5)}}  # engine 0 runs b's long batch
    for t in range(0, 60, 5):
        assert w.check(float(t), busy_neighbour, reps) == []
    w = StallWatch(after_s=5)
    w.check(0.0, _runs(), reps)
    assert w.check(6.0, _runs(fresh=False), reps) == []  # engine 0 did not answer this round
    assert [r for r, _ in w.check(6.5, _runs(), reps)] == ["r0"]


def test_another_replica_working_does_not_hide_a_stalled_one():
    w = StallWatch(after_s=5)
    for t, b in ((0.0, 10), (2.5, 20), (5.0, 30)):
        ends = w.check(t, _runs(b=(b, b)), {A: ([0], _live(7)), B: ([1], _live(b))})
    assert [r for r, _ in ends] == ["r0"] and "batch of a" in ends[0][1]


def test_nothing_is_ended_while_every_request_waits_for_its_prompt_or_none_is_live():
    w = StallWatch(after_s=5)
    assert w.check(0.0, _runs(), {A: ([0], _live(0, 0))}) == []
    assert w.check(60.0, _runs(), {A: ([0], _live(0, 0))}) == []
    assert w.check(61.0, _runs(), {A: ([0], [])}) == []
    w.check(62.0, _runs(), {A: ([0], _live(3))})
    assert w.check(66.9, _runs(), {A: ([0], _live(3))}) == []  # the clock restarted when it came back
