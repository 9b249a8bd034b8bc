"""EngineLoads and least-load dispatch: expected decode cycles per engine from the counts."""

from types import SimpleNamespace

import pytest

from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.engine.core.engine_loads import EngineLoads, StageCost, stage_costs
from paraflex.errors import ParaflexError

BIG, SMALL = StageCost(fixed=10.0, per_request=1.0), StageCost(fixed=4.0, per_request=0.5)


def _loads(routes, costs, max_batch=4):
    return EngineLoads(routes, costs, max_batch)


def test_cycle_sums_active_stages_and_pays_a_weight_read_per_batch():
    counts = {"a": [3, 0], "b": [5]}
    loads = _loads({"a": [[0], [1]], "b": [[0]]}, {"a": [BIG], "b": [SMALL]})
    # engine 0: a (3 requests, one batch) 10 + 3, b (5 requests, two batches of <= 4) 2 x 4 + 2.5
    assert loads.load(counts, 0) == pytest.approx(13 + 10.5) and loads.load(counts, 1) == 0
    assert loads.after(counts, "a", 0) == pytest.approx(23.5 + 1)  # a is active there: one more row
    assert loads.after(counts, "a", 1) == pytest.approx(11)  # not active: a weight read too
    counts["a"][0] = 4  # a full batch: the next request opens a second one
    assert loads.after(counts, "a", 0) == pytest.approx(24.5 + 11)


def test_cost_adds_a_weight_read_where_the_model_is_not_active_yet():
    counts = {"a": [2, 0], "b": [0, 6]}
    loads = _loads({"a": [[0], [1]], "b": [[0], [1]]}, {"a": [BIG], "b": [SMALL]}, max_batch=8)
    assert loads.cost(counts, "a", 0) == pytest.approx(12 + 1)  # active there: its own cycle with one more row
    assert loads.cost(counts, "a", 1) == pytest.approx(7 + 11 + 10)  # idle weights: the step it adds, and the read again


def test_a_pipeline_is_as_slow_as_its_busiest_engine():
    counts = {"p": [0], "q": [4]}
    loads = _loads({"p": [[0, 1]], "q": [[1]]}, {"p": [SMALL, SMALL], "q": [BIG]})
    assert loads.after(counts, "p", 0) == pytest.approx(14 + 4.5)


def test_routes_must_match_the_stage_costs():
    with pytest.raises(ParaflexError, match="does not match its 1 stage"):
        _loads({"a": [[0, 1]]}, {"a": [BIG]})
    with pytest.raises(ParaflexError, match="max_batch"):
        _loads({"a": [[0]]}, {"a": [BIG]}, max_batch=0)


def _dispatcher(homes=None):
    routes = {"a": [[0], [1]], "b": [[0], [1]]}
    return Dispatcher({"a": 2, "b": 2}, homes=homes, loads=EngineLoads(routes, {"a": [BIG], "b": [BIG]}, 8))


def _counts(d):
    return {m: d.outstanding(m) for m in ("a", "b")}


def test_least_load_keeps_a_model_on_its_home_until_a_spill_pays_for_its_weight_read():
    d = _dispatcher(homes={"a": 0, "b": 1})
    # a's home cycle 10 + n (one batch of <= 8) against 21 (a step of 11 plus the read again)
    # on the idle engine; the 9th request would open a second batch at home (29)
    assert [d.pick("a") for _ in range(9)] == [0] * 8 + [1]
    assert d.pick("b") == 1  # its home: 11 + 11 + 10 against 18 + 11 + 10 on engine 0
    assert d.pick("a") == 1  # a is active on engine 1 now: 22 + 1 there against 29 at home
    for _ in range(8):
        d.done("a", 0)
    assert d.pick("a") == 0  # home is idle again: 21, engine 1 holds 23 + 1


def test_least_load_ties_go_home_then_to_the_lowest_index():
    assert _dispatcher(homes={"a": 1}).pick("a") == 1
    assert _dispatcher().pick("a") == 0


def test_least_load_follows_live_replica_changes():
    d = _dispatcher(homes={"a": 0})
    with pytest.raises(ParaflexError, match="needs the engines"):
        d.add_replica("a")
    assert d.add_replica("a", [2]) == 2
    assert [d.pick("a") for _ in range(3)] == [0, 0, 0]
    assert d.pick("a", among=[2]) == 2 and d.loads.load(_counts(d), 2) == pytest.approx(11)
    d.remove_replica("a", 1)  # replica 2 (engine 2) is index 1 now
    assert d.outstanding("a") == [3, 1] and d.loads.load(_counts(d), 2) == pytest.approx(11) and d.loads.load(_counts(d), 1) == 0
    d.reorder("a", [1, 0])
    d.done("a", 0)  # the request on engine 2
    assert d.loads.load(_counts(d), 2) == 0 and d.loads.load(_counts(d), 0) == pytest.approx(13)


def test_stage_costs_split_a_step_into_its_batch_and_its_rows():
    class Linear:
        def decode_time(self, arch, layers, batch, context, first=False, last=False):
            return layers * (2.0 + 0.25 * batch) + (1.0 if last else 0.0)

    placement = SimpleNamespace(models={"m": SimpleNamespace(stages=[(0, 4), (4, 6)])})
    costs = stage_costs(placement, {"m": None}, Linear(), max_batch=16)
    assert costs["m"][0] == pytest.approx(StageCost(8.0, 1.0))
    assert costs["m"][1] == pytest.approx(StageCost(5.0, 0.5))


class _Flat:
    def decode_time(self, arch, layers, batch, context, first=False, last=False):
        return 1.0 + 0.1 * batch


def test_from_placement_builds_least_load_from_the_cost_model():
    arch = SimpleNamespace(weight_bytes=lambda: 10)
    config = SimpleNamespace(scheduler=SimpleNamespace(dispatch="least-load", home_margin=4, max_batch_size=8),
                             models=[SimpleNamespace(name="a", rate=2.0, arch=arch), SimpleNamespace(name="b", rate=1.0, arch=arch)])
    placement = SimpleNamespace(models={m: SimpleNamespace(replicas=[[0], [1]], stages=[(0, 2)]) for m in "ab"})
    d = Dispatcher.from_placement(placement, config, _Flat())
    assert d.homes == {"a": 0, "b": 1} and d.loads is not None
    # fixed 1.0, 0.1 per request: a stays home (1.2 against 2.1 on the idle engine), b goes home
    assert [d.pick("a") for _ in range(2)] == [0, 0] and d.pick("b") == 1
