"""Random event sequences over small multi-engine clusters (hypothesis): the engine-core invariants.

Checked after every step: no block owned twice, free + used = capacity (device and host),
a request's stage fully resident or fully swapped, queues in arrival order. Checked at the end:
no request lost (each ends finished or aborted, on every engine), all KV freed, and every
request finishes once arrivals stop (the run must go idle), with exactly max_new_tokens tokens.
"""

import os

import pytest
from engine_core_harness import Cluster, ModelSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraflex.engine.core.request import ABORTED, FINISHED


@st.composite
def clusters(draw, blocks=st.integers(96, 160)):
    n = draw(st.integers(2, 3))
    models = []
    for i in range(draw(st.integers(1, 3))):
        stages = draw(st.integers(1, n))
        engines = draw(st.permutations(range(n)))[:stages]
        layers = draw(st.lists(st.integers(1, 2), min_size=stages, max_size=stages))
        models.append(ModelSpec(f"m{i}", list(engines), layers, draw(st.sampled_from([128, 256, 512]))))
    policy = draw(st.sampled_from(["full-batch-first", "prefill-first", "sarathi"]))
    kw = {"prefill_token_budget": draw(st.integers(3, 24)), "starvation_limit": draw(st.sampled_from([None, 0, 4, 64]))}
    return Cluster(n, models, blocks=draw(blocks), host_blocks=4000, max_batch_size=draw(st.integers(1, 4)),
                   policy=policy, seed=draw(st.integers(0, 2**16)), overlap=draw(st.booleans()), sched_kwargs=kw)


events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 16), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 60)),
    ),
    max_size=60,
)


# PARAFLEX_PROPERTY_EXAMPLES raises the example count for a longer hunt (default keeps CI fast)
EXAMPLES = int(os.environ.get("PARAFLEX_PROPERTY_EXAMPLES", "150"))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), events)
def test_random_event_sequences_keep_invariants_and_finish(c, evs):
    max_new = {}
    for ev in evs:
        if ev[0] == "add":
            rid = f"r{len(max_new)}"
            model = c.models[ev[1] % len(c.models)].name
            c.add(rid, model, ev[2], ev[3])
            max_new[rid] = ev[3]
        elif ev[0] == "step":
            for _ in range(ev[1]):
                c.step()
                c.check()
        elif max_new:
            c.abort(f"r{ev[1] % len(max_new)}")
    c.run(max_steps=5000)  # arrivals stopped: everything must drain
    for e in c.engines:
        assert e.num_live == 0, [r for r in e.live_requests()]
        assert e.pool.num_used == 0 and e.pool.host_num_used == 0
        assert not e.has_ready_work()
    for rid, model in c.started.items():
        assert rid in c.finished or rid in c.aborted, rid
        for eid in c.spec[model].engines:
            assert c.engines[eid].state_of(rid) in (FINISHED, ABORTED, None)
        if rid not in c.aborted:
            assert c.tokens[rid] == max_new[rid], rid
    assert c.engines[c.spec[c.models[0].name].engines[0]].state_of("r-never") is None


@pytest.mark.slow
@settings(max_examples=max(25, EXAMPLES // 6), deadline=None)
@given(clusters(blocks=st.just(60)))
def test_swapping_under_pressure_never_loses_a_request(c):
    # 30 requests into 60-block pools (a full batch of the longest requests still fits one
    # stage alone): eviction and swap-in on many runs
    for i in range(30):
        c.add(f"r{i}", c.models[i % len(c.models)].name, 1 + (i * 7) % 9, 1 + i % 6)
    c.run(max_steps=20000)
    assert c.finished == set(c.started)
    for rid in c.started:
        assert c.tokens[rid] == 1 + int(rid[1:]) % 6


def test_a_pressured_pipeline_swaps_and_still_finishes_everything():
    c = Cluster(3, [ModelSpec("big", [0, 1, 2], [2, 2, 2], 512), ModelSpec("small", [1], [1], 128)],
                blocks=48, host_blocks=4000, max_batch_size=2, seed=7)
    for i in range(24):
        c.add(f"b{i}", "big", 3 + i % 5, 6)
        c.add(f"s{i}", "small", 4, 3)
    c.run(max_steps=20000)
    assert c.finished == set(c.started)
    assert sum(e.stats["swap_outs"] for e in c.engines) > 0
    # some finish while swapped out (freed from the host pool), the others came back in
    assert 0 < sum(e.stats["swap_ins"] for e in c.engines) <= sum(e.stats["swap_outs"] for e in c.engines)
    assert all(e.pool.num_used == 0 and e.pool.host_num_used == 0 for e in c.engines)
