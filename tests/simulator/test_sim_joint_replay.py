"""The joint replay (simulator/fastpath/joint_replay.py) gives exactly the results of the step-by-step
event path: a 3-stage pipeline whose engines also hold one-stage replicas (the base case's
llama-2-70b pattern), on random workloads (hypothesis) and on hand-made ones that force its
corner cases (starvation promotions between the one-stage batches, a one-stage batch running
when the pipeline's batch is formed, KV growth), with the replay checked to run."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


from paraflex.config.schema import Config, WorkloadConfig
from paraflex.engine.core.queue_order import QueueOrder
from paraflex.engine.core.scheduler import EngineScheduler
from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.simulator.core.cluster import Cluster
from paraflex.simulator.fastpath.joint_replay import JointReplay
from paraflex.simulator.fastpath.joint_decide import GroupDecisions, Stop
from paraflex.simulator.fastpath.joint_sim import GroupSim
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems.layouts import SystemLayout
from paraflex.simulator.workload import SimRequest
from repo_paths import CONFIGS
from sim_cases import assert_same_results

# name, arch, engines of its replicas (one route each: a pipeline if it has several engines)
MODELS = [("p", "tiny-8l", [[0, 1, 2]]), ("a", "tiny-2l", [[0], [2], [3]]), ("b", "tiny-4l", [[1], [2]]),
          ("d", "tiny-2l", [[1]]), ("e", "tiny-2l", [[3]])]


def _config(memory_gb: float, max_batch: int, policy: str = "full-batch-first", workload=None,
            dispatch: str = "least-outstanding", **cluster) -> Config:
    """`cluster`: more keys of the cluster section (nodes, node_interconnect_*)."""
    d = {
        "cluster": {"num_engines": 4, "device": "cpu", "memory_gb": memory_gb, "host_memory_gb": 0.01, **cluster},
        "models": [{"name": n, "arch": a} for n, a, _ in MODELS],
        # the joint replay serves the paper's unbounded rule (the in-flight bound turns it off);
        # the cases below are built around the paper's least-outstanding dispatch
        "scheduler": {"max_batch_size": max_batch, "policy": policy, "block_bytes": 4096,
                      "decode_batches_in_flight": "unbounded", "dispatch": dispatch},
    }
    if workload is not None:
        d["workload"] = dataclasses.asdict(workload)
    return Config.from_dict(d)


def _layout(config: Config, policy: str = "full-batch-first") -> SystemLayout:
    """Model p in 3 stages on engines 0-2; one-stage replicas of a, b, d beside its stages
    (engine 1 holds p's middle stage, b and d; engine 2 p's last stage, a and b)."""
    from paraflex.planner.problem import split_layers

    engines = [EnginePlacement(e, [], 0, {}) for e in range(4)]
    models = {}
    for (name, _, routes), mc in zip(MODELS, config.models):
        cuts = list(split_layers(mc.arch.num_layers, len(routes[0])))
        models[name] = ModelPlacement(name, mc.arch.num_layers, cuts, routes)
        for j, route in enumerate(routes):
            for k, e in enumerate(route):
                a, b = cuts[k]
                engines[e].stages.append(StageRef(name, j, k))
                engines[e].weight_bytes += mc.arch.stage_weight_bytes(a, b, k == 0, k == len(route) - 1)
    return SystemLayout("group", Placement(1, "hand", {}, 0.0, models, engines), policy, 1, config.cluster.memory_bytes)


class _Spy:
    """Counts the decisions the joint replay replays (keeps each run's JointReplay)."""

    def __init__(self, monkeypatch):
        self.replays = []
        real = JointReplay.__init__

        def init(replay, *args):
            real(replay, *args)
            self.replays.append(replay)

        monkeypatch.setattr(JointReplay, "__init__", init)

    @property
    def decisions(self) -> int:
        return sum(r.decisions for r in self.replays)


def _both(cfg, layout, requests=None, rate=1.0, seed=0, check=False):
    """(with the fast paths, step by step); `check`: invariants checked after every event of
    the fast run (the step-by-step run is the reference)."""
    return [simulate(cfg, SimSettings(system="group", rate=rate, seed=seed, fast_forward=ff, check_invariants=check and ff),
                     layout=layout, requests=requests) for ff in (True, False)]


def _counters(res):
    """Each engine's scheduler counters at the end of a run (decisions, sequence numbers, batch
    ids, swaps, starvation promotions) and what it still holds (requests, free blocks): the
    replay must leave them as one by one."""
    return [(e.scheduler.decisions, e.scheduler.requests.seq, e.scheduler.first_stage.batch_seq, e.scheduler.stats,
             sorted(r.req_id for r in e.scheduler.live_requests()), e.pool.num_free) for e in res.engines]


def _assert_identical(fast, plain):
    assert_same_results(fast, plain)
    assert _counters(fast) == _counters(plain)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), memory_gb=st.sampled_from([0.012, 0.02, 0.1]), max_batch=st.sampled_from([2, 4, 16]),
       rate=st.sampled_from([3.0, 10.0, 40.0]), cv=st.sampled_from([1.0, 4.0]),
       policy=st.sampled_from(["full-batch-first", "full-batch-first", "prefill-first"]),
       starvation=st.sampled_from([None, None, 1, 3]), dispatch=st.sampled_from(["least-outstanding", "home-first", "least-load"]))
def test_random_workloads_identical_with_and_without_fast_paths(seed, memory_gb, max_batch, rate, cv, policy, starvation,
                                                                 dispatch):
    """`starvation`: a starvation limit of that many decisions instead of the default 64
    (promotions then happen inside most replays); `dispatch`: the fast path's proof that an
    arrival goes outside a group holds under each rule (least load: it proves none)."""
    w = WorkloadConfig(arrival="lognormal", cv=cv, num_requests=30, seed=seed, output_scale=1.0)
    cfg = _config(memory_gb, max_batch, policy, w, dispatch=dispatch)
    with pytest.MonkeyPatch.context() as mp:
        if starvation is not None:
            mp.setattr(QueueOrder, "effective_starvation_limit", property(lambda self: starvation))
        fast, plain = _both(cfg, _layout(cfg, policy), rate=rate, seed=seed)
    _assert_identical(fast, plain)


def _long_requests(spec):
    """(model, arrival, prompt, output) tuples as SimRequests."""
    return [SimRequest(i, m, a, p, o) for i, (m, a, p, o) in enumerate(spec)]


def test_pipeline_among_one_stage_replicas_is_replayed_exactly(monkeypatch):
    """p's requests come first (its batches win every engine's order), a, b and d decode
    beside it on all three of its engines; KV grows by many blocks on the way."""
    spy = _Spy(monkeypatch)
    cfg = _config(0.1, 8)
    reqs = _long_requests([("p", 0.0, 7, 200), ("a", 0.01, 5, 150), ("b", 0.011, 9, 180), ("d", 0.012, 3, 160),
                           ("b", 0.013, 4, 170), ("a", 0.014, 6, 140), ("p", 0.5, 5, 100), ("a", 0.8, 3, 80)])
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    assert spy.decisions > 100
    assert fast.summary["events"] < plain.summary["events"] / 3


def test_the_in_flight_bound_turns_the_replay_off_with_identical_results(monkeypatch):
    """With `decode_batches_in_flight: stages` (the default) a first stage holds under-sized
    decode batches back while the pipeline is full, which the replay does not model: it must
    decline, and the fast paths left still give the step-by-step results."""
    spy = _Spy(monkeypatch)
    cfg = _config(0.1, 8)
    cfg.scheduler.decode_batches_in_flight = "stages"
    reqs = _long_requests([("p", 0.0, 7, 200), ("a", 0.01, 5, 150), ("p", 0.02, 5, 120), ("b", 0.011, 9, 180),
                           ("p", 0.05, 3, 90), ("d", 0.012, 3, 160), ("p", 0.5, 5, 100), ("a", 0.8, 3, 80)])
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    assert spy.decisions == 0


def test_starvation_promotions_inside_the_replay(monkeypatch):
    """b and d share engine 1 with p's middle stage; b is older, so d waits for its starvation
    promotion every limit decisions, inside the replayed cycles (same promotions)."""
    spy = _Spy(monkeypatch)
    cfg = _config(0.1, 8)
    reqs = _long_requests([("p", 0.0, 4, 400), ("b", 0.001, 4, 500), ("d", 0.002, 4, 400)])
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    promotions = [[e.scheduler.stats["starvation_promotions"] for e in r.engines] for r in (fast, plain)]
    assert promotions[0] == promotions[1] and promotions[0][1] > 0
    assert spy.decisions > 50


def test_one_stage_batches_older_than_the_pipeline(monkeypatch):
    """a and b arrive before p: they win their engines' order, p's stages wait for the
    one-stage steps (and for promotions) in the replayed cycles."""
    spy = _Spy(monkeypatch)
    cfg = _config(0.1, 4)
    reqs = _long_requests([("a", 0.0, 4, 300), ("b", 0.0005, 4, 300), ("p", 0.001, 4, 250), ("d", 0.002, 4, 200)])
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    assert spy.decisions > 0


@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.tuples(st.floats(0, 5), st.floats(0, 2), st.integers(1, 8)), max_size=12),
       before=st.lists(st.tuples(st.floats(0, 5), st.floats(0, 2)), max_size=3))
def test_decode_steps_equal_one_batch_call_each(runs, before):
    """`MetricsStore.decode_steps` (the joint replay's metrics) records what `batch` per
    decode batch records: busy intervals merged the same way, counts, sizes in order."""
    from paraflex.simulator.metrics.records import MetricsStore, ModelSLO

    def ordered(pairs):  # back-to-back or gapped intervals in time order
        out, t = [], 0.0
        for gap, dur, *rest in pairs:
            t += gap
            out.append((t, t + dur, *rest))
            t += dur
        return out

    stores = [MetricsStore({"m": ModelSLO(1.0, 0.1)}, 1, 1) for _ in range(2)]
    for s in stores:
        for a, b in ordered(before):
            s.batch(0, a, b, True, 1, 7)
    start = ordered(before)[-1][1] if before else 0.0
    steps = [(start + a, start + b, n) for a, b, n in ordered(runs)]
    for a, b, n in steps:
        stores[0].batch(0, a, b, False, n, n)
    stores[1].decode_steps(0, steps)
    one, bulk = stores
    assert list(one.busy[0]) == list(bulk.busy[0])
    assert list(one.decode_batch_sizes) == list(bulk.decode_batch_sizes)
    assert (one.batches, one.batch_tokens, one.decode_batches) == (bulk.batches, bulk.batch_tokens, bulk.decode_batches)


def test_paper_base_case_pipeline_is_replayed(monkeypatch):
    """The §8.2 base case at 64 GPUs: llama-2-70b's 3-stage pipelines on engines 0-2 and 3-5
    share them with one-stage replicas; the joint replay takes most of their decisions."""
    from paraflex.config.schema import load_config
    from paraflex.simulator.systems.layouts import build_system

    spy = _Spy(monkeypatch)
    cfg = load_config(str(CONFIGS / "paper-base.yaml"))
    cfg.cluster.num_engines = 8
    cfg.scheduler.decode_batches_in_flight = "unbounded"  # the paper's rule, which the replay serves
    # the paper's dispatch: home-first sends more arrivals into the group than the replay can
    # prove it avoids (700 decisions replayed here instead of over 1000; docs/engine-core.md)
    cfg.scheduler.dispatch = "least-outstanding"
    cfg.workload = dataclasses.replace(cfg.workload, duration_s=None, num_requests=150)
    layout = build_system(cfg, SimSettings(system="paraflex"))
    res = simulate(cfg, SimSettings(system="paraflex", rate=4.0, seed=0), layout=layout)
    assert spy.decisions > 1000
    assert res.summary["events"] < 15 * res.summary["requests"]


class _Arrivals:
    """Counts what waiting replays do at their horizon: go on (the new request went outside
    the group), admit it (it came in) or cut (it came in and cannot be admitted, or another new
    request of the group's models came at once); and the last tokens replayed."""

    def __init__(self, monkeypatch):
        self.resumed = self.cut = self.admitted = self.finishes = 0
        self.inside = False
        real_arrival, real_cut, real_finished = JointReplay.arrival, GroupSim.cut_paused, JointReplay.finished

        def arrival(replay, req, replica, route, t):
            waiting = sum(sim.paused[0] == t and req.model in sim.bounds[0] for sim in replay.suspended)
            cut = self.cut
            self.inside = True
            admitted = real_arrival(replay, req, replica, route, t)
            self.inside = False
            self.admitted += admitted
            self.resumed += waiting - (self.cut - cut) - admitted
            return admitted

        def cut_paused(sim):
            self.cut += self.inside
            real_cut(sim)

        def finished(replay, sim, t):
            self.finishes += sum(len(rids) for _, rids in sim.finishing)
            real_finished(replay, sim, t)

        monkeypatch.setattr(JointReplay, "arrival", arrival)
        monkeypatch.setattr(GroupSim, "cut_paused", cut_paused)
        monkeypatch.setattr(JointReplay, "finished", finished)


def _finish_of(cfg, reqs, rid: int) -> float:
    """When request `rid` finishes step by step."""
    plain = simulate(cfg, SimSettings(system="group", rate=1.0, fast_forward=False), layout=_layout(cfg), requests=reqs)
    return plain.metrics.requests[rid].finish


def _outside_race(arrival: float | None, output: int = 60):
    """p decodes on engines 0-2 beside a's replicas 0 (engine 0) and 1 (engine 2), each
    holding one long request; a's replica 2 (engine 3, outside the group) holds a short one.
    A new request of a (`output` tokens) at `arrival` goes to replica 0 (inside) while replica
    2's request runs, to replica 2 (outside) once it finished (ties go to the lowest replica)."""
    spec = [("p", 0.0, 6, 300), ("a", 0.001, 5, 400), ("a", 0.002, 5, 400), ("a", 0.003, 4, 30), ("b", 0.004, 3, 250)]
    if arrival is not None:
        spec.append(("a", arrival, 4, output))
    return _long_requests(spec)


def test_replay_goes_on_past_a_request_dispatched_outside(monkeypatch):
    """The replay waits at the new request of a (it may come into the group: replica 2 is
    busy when the replay starts); the request goes outside, and the replay goes on."""
    cfg = _config(0.1, 8)
    done = _finish_of(cfg, _outside_race(None), 3)
    spy, arrivals = _Spy(monkeypatch), _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=_outside_race(done + 0.05))
    _assert_identical(fast, plain)
    assert plain.metrics.requests[5].replica == 2
    assert arrivals.resumed >= 1 and spy.decisions > 100


def test_replay_admits_a_request_dispatched_inside(monkeypatch):
    """Same, with the new request while replica 2 still holds its request: it comes into the
    group (replica 0, beside its decoding request on engine 0); the replay admits it (its
    prompt formed in the replay, then it joins the batch a step later than the other member)."""
    cfg = _config(0.1, 8)
    done = _finish_of(cfg, _outside_race(None), 3)
    arrivals = _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=_outside_race(done / 2), check=True)
    _assert_identical(fast, plain)
    assert plain.metrics.requests[5].replica == 0
    assert arrivals.admitted >= 1 and arrivals.cut == 0


def test_replay_is_cut_at_a_request_it_cannot_admit(monkeypatch):
    """Same with a request of one token (its first token is its last: finished at its prompt's
    end, which the replay does not model): the replay is cut at its arrival."""
    cfg = _config(0.1, 8)
    done = _finish_of(cfg, _outside_race(None), 3)
    arrivals = _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=_outside_race(done / 2, output=1))
    _assert_identical(fast, plain)
    assert plain.metrics.requests[5].replica == 0
    assert arrivals.cut >= 1


def _around(t: float, shift: int) -> float:
    """The float just before t (shift -1), t itself (0) or the float just after it (1)."""
    return {-1: math.nextafter(t, 0.0), 0: t, 1: math.nextafter(t, math.inf)}[shift]


def _race_at_finish(monkeypatch, race, rid: int, shift: int):
    """`race(at)` with its new request just before (shift -1), at (0) or just after (1) the
    instant request `rid` finishes step by step, with and without the fast paths (asserted
    identical): (the step-by-step result, what the replays did at new requests)."""
    cfg = _config(0.1, 8)
    at = _around(_finish_of(cfg, race(None), rid), shift)
    arrivals = _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=race(at))
    _assert_identical(fast, plain)
    return plain, arrivals


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_request_at_the_instant_a_finish_changes_the_dispatchers_choice(monkeypatch, shift):
    """The new request of a arrives just before, exactly at, or just after the instant replica
    2's request finishes (a finish at an instant is seen by a request arriving at it): inside
    (admitted), outside, outside, as step by step."""
    plain, arrivals = _race_at_finish(monkeypatch, _outside_race, 3, shift)
    assert plain.metrics.requests[5].replica == (0 if shift < 0 else 2)
    assert (arrivals.admitted if shift < 0 else arrivals.resumed) >= 1  # a replay waited for it


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_a_request_of_a_model_off_the_group_at_the_same_instant_leaves_the_replay_waiting(monkeypatch, share):
    """A request of e (resident only on engine 3, outside the group) comes at the same instant
    as the request of a the replay waits for, and is dispatched first; a's goes into the group
    (replica 2 is still busy): the replay must not go on past it on e's word, but admit it (or
    be cut there), as step by step."""
    cfg = _config(0.1, 8)
    at = share * _finish_of(cfg, _outside_race(None), 3)
    spec = [(r.model, r.arrival, r.prompt_len, r.output_len) for r in _outside_race(None)]
    reqs = _long_requests(spec + [("e", at, 3, 20), ("a", at, 4, 60)])
    arrivals = _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    assert plain.metrics.requests[6].replica == 0  # a's request went into the group
    assert arrivals.cut + arrivals.admitted >= 1


def test_two_requests_at_one_instant_cut_the_waiting_replay(monkeypatch):
    """Two new requests of the group's models at the same instant (the first goes outside):
    the replay is cut there, not resumed past the second."""
    cfg = _config(0.1, 8)
    done = _finish_of(cfg, _outside_race(None), 3)
    reqs = _outside_race(done + 0.05) + [SimRequest(6, "b", done + 0.05, 3, 40)]
    arrivals = _Arrivals(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)
    assert arrivals.cut >= 1


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(st.tuples(st.sampled_from("aaaaab"), st.floats(0.01, 0.6), st.integers(1, 12), st.integers(2, 60)),
                     min_size=3, max_size=14),
       outputs=st.tuples(st.integers(200, 600), st.integers(2, 300), st.integers(300, 600)),
       max_batch=st.sampled_from([4, 16]))
def test_random_requests_around_waiting_replays(spec, outputs, max_batch):
    """Random short requests of a (a replica outside the group, on engine 3) and b beside p's
    and a's long requests (a's first two hold its replicas in the group): the replays wait at
    many new requests, go on past those dispatched outside and are cut at those dispatched
    inside; identical to step by step."""
    cfg = _config(0.1, max_batch)
    reqs = _long_requests([("p", 0.0, 6, outputs[0]), ("a", 0.001, 5, outputs[2]), ("a", 0.002, 5, outputs[2]),
                           ("p", 0.2, 3, outputs[1])] + sorted(spec, key=lambda r: r[1]))
    fast, plain = _both(cfg, _layout(cfg), requests=reqs)
    _assert_identical(fast, plain)


def _finish_race(arrival: float | None):
    """a's replicas 0 and 1 (engines 0 and 2, in p's group) hold two requests each, replica 2
    (engine 3) one; request 3 (on replica 0) is short and finishes inside a replay. Before its
    finish a new request of a goes to replica 2 (outside), from its finish on to replica 0."""
    spec = [("p", 0.0, 6, 400), ("a", 0.001, 5, 400), ("a", 0.002, 5, 400), ("a", 0.003, 4, 400),
            ("a", 0.004, 3, 40), ("a", 0.005, 4, 400), ("b", 0.006, 3, 300)]
    if arrival is not None:
        spec.append(("a", arrival, 4, 60))
    return _long_requests(spec)


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_finish_inside_the_replay_just_before_a_request(monkeypatch, shift):
    """Request 4 finishes inside a replay (its replica's batch goes on with one member); a
    new request of a arrives just before, exactly at, or just after that finish: the
    dispatcher sees the finish at its time (replica 2 outside, then replica 0 inside)."""
    plain, arrivals = _race_at_finish(monkeypatch, _finish_race, 4, shift)
    assert plain.metrics.requests[7].replica == (2 if shift < 0 else 0)
    assert arrivals.finishes >= 1


def test_finishes_inside_the_replay_empty_a_replica(monkeypatch):
    """One-stage requests finish one after another inside the replays (a replica's batch
    shrinks, then empties), with the pipeline's batches in flight; KV freed in order with
    the growth under memory pressure."""
    arrivals = _Arrivals(monkeypatch)
    _identical_on([("p", 0.0, 6, 300), ("a", 0.001, 5, 30), ("a", 0.002, 5, 60), ("b", 0.003, 9, 45),
                   ("b", 0.004, 4, 90), ("d", 0.005, 3, 70), ("a", 0.006, 6, 120), ("b", 0.007, 2, 20)], 0.02, 8)
    assert arrivals.finishes >= 4


class _Joins:
    """Counts the one-stage prompts the replays take over or form: joined (their end replayed,
    the request in its replica's batch) and still running at the cut."""

    def __init__(self, monkeypatch):
        self.joined = self.running = 0
        real_join, real_apply = GroupSim.join, GroupSim.apply

        def join(sim, es, jn):
            self.joined += 1
            real_join(sim, es, jn)

        def apply(sim):
            self.running += sum(not jn.joined for es in sim.group for jn in [es.joiner, *es.prompts] if jn is not None)
            real_apply(sim)

        monkeypatch.setattr(GroupSim, "join", join)
        monkeypatch.setattr(GroupSim, "apply", apply)


def _prompts_during(spec_prompts):
    """p and a's replicas 0 (engine 0) and 1 (engine 2) decode long requests; then prompts of
    the group's one-stage replicas (model, arrival, prompt, output) come in."""
    return _long_requests([("p", 0.0, 6, 400), ("a", 0.001, 5, 500), ("a", 0.002, 5, 500), ("a", 0.003, 4, 500)]
                          + spec_prompts)


_MEMORY = st.sampled_from([0.012, 0.02, 0.1])  # GB per engine: KV pressure to none
_BATCH = st.sampled_from([2, 4, 16])


def _specs(models: str, earliest: float, prompt: int, output: int):
    """3-12 requests (model drawn from `models`, arrival in [earliest, 0.3], prompt and output
    lengths up to `prompt` and `output`)."""
    return st.lists(st.tuples(st.sampled_from(models), st.floats(earliest, 0.3), st.integers(1, prompt),
                              st.integers(2, output)), min_size=3, max_size=12)


def _identical_on(spec, memory_gb: float, max_batch: int, requests=_long_requests) -> None:
    """`requests(spec in arrival order)` with the fast paths (invariants checked) and step by
    step: identical."""
    cfg = _config(memory_gb, max_batch)
    fast, plain = _both(cfg, _layout(cfg), requests=requests(sorted(spec, key=lambda r: r[1])), check=True)
    _assert_identical(fast, plain)


def _joins_identical(monkeypatch, prompts) -> _Joins:
    """Run `_prompts_during(prompts)` with the fast paths (invariants checked) and step by
    step; assert identical; return what the replays did with the prompts."""
    cfg = _config(0.1, 8)
    joins = _Joins(monkeypatch)
    fast, plain = _both(cfg, _layout(cfg), requests=_prompts_during(prompts), check=True)
    _assert_identical(fast, plain)
    return joins


def test_prompt_running_at_the_start_joins_its_replicas_batch(monkeypatch):
    """New requests of a (into replicas 0 and 1, beside their decoding requests) and of b and d
    (their replicas empty: the request starts a batch) run their prompts while the pipeline
    decodes; replays start with those prompts running and take them over: the request joins
    the batch formed after its prompt, in key order."""
    joins = _joins_identical(monkeypatch, [("a", 0.05, 30, 120), ("b", 0.1, 25, 90), ("d", 0.15, 40, 70), ("a", 0.2, 20, 100)])
    assert joins.joined >= 2


def test_prompt_whose_first_decode_step_is_its_last(monkeypatch):
    """Requests of two tokens: the first at the prompt's end, the second in the first step
    after the join (a step with last tokens inside the replay, or formed for real at a cut)."""
    joins = _joins_identical(monkeypatch, [("a", 0.05, 30, 2), ("b", 0.1, 12, 2), ("a", 0.15, 8, 2), ("d", 0.2, 9, 3)])
    assert joins.joined >= 1


def test_prompt_still_running_at_the_cut(monkeypatch):
    """A long prompt of b runs on engine 1 when requests of a come into the group (to replica
    0 on engine 0, then 1 on engine 2) before it ends, of one token each (the replay cannot
    admit them): the replay is cut with the prompt still running (completed at the cut, the
    engine held until its end), as step by step."""
    joins = _joins_identical(monkeypatch, [("b", 0.05, 4000, 60), ("a", 0.1, 6, 1), ("a", 0.15, 5, 1)])
    assert joins.running >= 1


def test_admitted_prompt_refused_above_the_kv_watermark(monkeypatch):
    """With a high KV watermark (85% of each pool kept free) and long contexts, an admitted
    request's prompt does not fit when its engine chooses it: `schedule` would go on to other
    queues, so the replay is cut there (a review's case); identical to step by step."""
    real_init = EngineScheduler.__init__

    def init(sched, *args, **kw):
        real_init(sched, *args, **{**kw, "watermark": 0.85})

    monkeypatch.setattr(EngineScheduler, "__init__", init)
    refused = []
    real_serve = GroupDecisions.serve_prompt

    def serve_prompt(decisions, sim, es, adm, x):
        try:
            real_serve(decisions, sim, es, adm, x)
        except Stop:
            refused.append(adm.rid)
            raise

    monkeypatch.setattr(GroupDecisions, "serve_prompt", serve_prompt)
    cfg = _config(0.012, 16)
    spec = [("p", 0.0, 104, 400), ("a", 0.001, 288, 500), ("a", 0.002, 273, 500), ("b", 0.003, 128, 400),
            ("d", 0.004, 212, 400), ("b", 0.0334, 105, 55), ("d", 0.0455, 104, 38), ("d", 0.1028, 42, 41),
            ("b", 0.1175, 38, 58), ("a", 0.1246, 48, 58), ("a", 0.1599, 109, 8), ("d", 0.2267, 127, 20),
            ("b", 0.2610, 160, 22), ("a", 0.2623, 33, 48), ("a", 0.2756, 20, 54), ("b", 0.2789, 132, 32),
            ("a", 0.2922, 187, 55), ("a", 0.3043, 92, 28), ("d", 0.3181, 118, 3), ("b", 0.3884, 144, 30),
            ("d", 0.4043, 157, 34), ("a", 0.4304, 194, 18), ("a", 0.4428, 163, 45), ("d", 0.4694, 110, 41),
            ("d", 0.4744, 34, 9)]
    fast, plain = _both(cfg, _layout(cfg), requests=_long_requests(spec), check=True)
    _assert_identical(fast, plain)
    assert refused


def test_requests_admitted_one_after_another_on_one_engine(monkeypatch):
    """Requests of d (its one replica on engine 1, beside p's middle stage and b) come while
    the replays run: each is admitted, its prompt formed in the replay, and joins d's batch,
    which has run steps by then (so it joins late); several in one replay; identical to step
    by step, invariants checked."""
    most = []
    real_apply = GroupSim.apply

    def apply(sim):
        most.append(max(len(es.prompts) for es in sim.group))
        real_apply(sim)

    monkeypatch.setattr(GroupSim, "apply", apply)
    arrivals = _Arrivals(monkeypatch)
    cfg = _config(0.1, 8)
    reqs = _prompts_during([("d", 0.05, 20, 60), ("d", 0.07, 9, 80), ("d", 0.09, 14, 40), ("d", 0.11, 30, 70)])
    fast, plain = _both(cfg, _layout(cfg), requests=reqs, check=True)
    _assert_identical(fast, plain)
    assert arrivals.admitted >= 3 and max(most) >= 2


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_specs("aabdd", 0.01, 400, 80), memory_gb=_MEMORY, max_batch=_BATCH)
def test_random_prompts_into_replays(spec, memory_gb, max_batch):
    """Random prompts of the group's one-stage models (short and long, memory pressure, small
    batches) while the pipeline and a's replicas decode: replays take over running prompts
    that join, finish or are cut; identical to step by step, invariants checked."""
    _identical_on(spec, memory_gb, max_batch, _prompts_during)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(st.tuples(st.sampled_from("ppabdd"), st.sampled_from([0.0, 0.02, 0.05, 0.1]), st.integers(1, 30),
                               st.integers(2, 120)), min_size=4, max_size=12),
       max_batch=st.sampled_from([2, 4, 16]))
def test_requests_with_equal_arrival_times(spec, max_batch):
    """Requests of the pipeline and of the one-stage replicas arriving at the same instants
    (a trace with coarse timestamps): queue orders then depend on sequence numbers, which the
    replay does not model, so it waits until no two of the group's requests (outside one
    replica's batch) tie; identical to step by step."""
    _identical_on(spec, 0.1, max_batch)


class _PipeFinishes:
    """Counts the pipeline's requests that produce their last token in a replay: finished
    inside it (`GroupSim.pipe_finish`), or in a last stage running at a cut (finished at
    its end by `Cluster.replay_done`)."""

    def __init__(self, monkeypatch):
        self.inside = self.at_cut = 0
        real_finish, real_done = GroupSim.pipe_finish, Cluster.replay_done

        def pipe_finish(sim, b):
            self.inside += len(sim.last_tokens(b))
            real_finish(sim, b)

        def replay_done(cluster, eng, key, t, finished):
            self.at_cut += len(finished)
            real_done(cluster, eng, key, t, finished)

        monkeypatch.setattr(GroupSim, "pipe_finish", pipe_finish)
        monkeypatch.setattr(Cluster, "replay_done", replay_done)


def test_pipeline_requests_finish_inside_the_replay(monkeypatch):
    """p's requests of different lengths finish one after another while a, b and d decode on
    its engines, under memory pressure: each frees its KV on the later stages at its last
    stage's end (in order with the growth there) and on the first when its token is back,
    and the dispatcher sees it at its time; identical to step by step, invariants checked."""
    finishes = _PipeFinishes(monkeypatch)
    _identical_on([("p", 0.0, 6, 40), ("p", 0.001, 9, 25), ("p", 0.002, 4, 90), ("a", 0.003, 5, 200),
                   ("b", 0.004, 7, 180), ("d", 0.005, 3, 150), ("p", 0.006, 5, 2), ("a", 0.007, 4, 160)], 0.02, 8)
    assert finishes.inside >= 3


def test_pipeline_finish_while_a_last_token_step_runs_at_a_cut(monkeypatch):
    """p's requests finish (their KV freed on engine 1, p's middle stage) while a one-stage
    step with last tokens runs there, and the replay is cut before that step ends (it is
    formed for real at the cut, its replayed growth dropped): the frees must stay (a review's
    reproducer: they were dropped with it, leaving the finished requests' blocks in the pool)."""
    monkeypatch.setattr(QueueOrder, "effective_starvation_limit", property(lambda self: 3))
    cfg = _config(0.012, 16)
    spec = [("p", 0.0024131619913530422, 14, 8), ("p", 0.002795803965364128, 34, 2), ("b", 0.003390591923069348, 17, 12),
            ("d", 0.0098072886371421, 35, 200), ("a", 0.010138440152618717, 28, 123), ("p", 0.01224550185437809, 19, 19),
            ("d", 0.01355406294419674, 1, 84), ("d", 0.026782841519972143, 11, 168), ("p", 0.03017276503355571, 26, 49)]
    fast, plain = _both(cfg, _layout(cfg), requests=_long_requests(spec), check=True)
    _assert_identical(fast, plain)


def _pipe_finish_race(arrival: float | None):
    """p's request 1 is short and finishes while p's request 0 and a's replicas (one long
    request each, so a new request of a goes to replica 0, inside the group) decode. The new
    request has one token: the replay cannot admit it, so it is cut there."""
    spec = [("p", 0.0, 6, 300), ("p", 0.001, 5, 30), ("a", 0.002, 5, 400), ("a", 0.003, 4, 400),
            ("a", 0.004, 3, 400), ("b", 0.005, 4, 250)]
    if arrival is not None:
        spec.append(("a", arrival, 4, 1))
    return _long_requests(spec)


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_request_into_the_group_around_a_pipeline_finish(monkeypatch, shift):
    """A new request of a comes into the group just before p's request 1 finishes (the cut
    finds the last stage running the batch with its last token: it finishes at the stage's
    end, `Cluster.replay_done`), exactly then, or just after (finished inside the replay)."""
    finishes = _PipeFinishes(monkeypatch)
    plain, _ = _race_at_finish(monkeypatch, _pipe_finish_race, 1, shift)
    assert plain.metrics.requests[6].replica == 0
    if shift < 0:
        assert finishes.at_cut >= 1
    else:
        assert finishes.inside >= 1


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_specs("pppabd", 0.0, 40, 60), memory_gb=_MEMORY, max_batch=_BATCH)
def test_random_pipeline_finishes(spec, memory_gb, max_batch):
    """Many short requests of the pipeline among the one-stage replicas' (memory pressure,
    small batches): pipeline finishes inside replays, at cuts and step by step; identical,
    invariants checked."""
    _identical_on(spec, memory_gb, max_batch)


# engines 0, 1 on one node, 2, 3 on another: p's hop 1 -> 2 and its tokens 2 -> 0 cross nodes
SLOW_NODES = {"nodes": [2, 2], "node_interconnect_gbps": 0.05, "node_interconnect_latency_us": 2000}


@pytest.mark.parametrize("seed", [1, 2])
def test_hops_between_nodes_are_replayed_exactly_and_cost_their_link(seed):
    w = WorkloadConfig(arrival="lognormal", cv=2.0, num_requests=30, seed=seed, output_scale=1.0)
    cfg = _config(0.05, 8, workload=w, **SLOW_NODES)
    fast, plain = _both(cfg, _layout(cfg), rate=10.0, seed=seed)
    _assert_identical(fast, plain)
    one = _config(0.05, 8, workload=w)
    flat, _ = _both(one, _layout(one), rate=10.0, seed=seed)

    def tbt(res, model):  # mean time per output token of the model's requests
        rows = [r for r in res.metrics.requests.values() if r.model == model and r.tokens > 1]
        return sum((r.finish - r.first_token) / (r.tokens - 1) for r in rows) / len(rows)

    # each of p's decode steps pays the slow hop (2 ms + bytes) and the slow token latency (2 ms),
    # partly hidden behind the other decode batches in flight
    assert tbt(fast, "p") > tbt(flat, "p") + 0.002
    assert tbt(fast, "e") == pytest.approx(tbt(flat, "e"), rel=0.5)  # one stage: no hops
