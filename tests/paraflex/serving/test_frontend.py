"""The serving frontend (paraflex/serving/frontend.py) as pure logic over recording engine
handles: dispatch, output routing, ends and frees, restarts by recompute, engines going down,
and the package's lazy `LLMCluster`."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.serving.backend import Unavailable
from paraflex.serving.frontend import Frontend

PARAMS = SamplingParams(max_tokens=10)


class Engines:
    """Records what the frontend asks of the engines."""

    def __init__(self):
        self.calls = []

    def add_request(self, engine, model, engine_rid, prompt, params):
        self.calls.append(("add", engine, engine_rid, list(prompt), params.max_tokens))

    def free(self, engine, model, engine_rids):
        self.calls.append(("free", engine, list(engine_rids)))


class Sink:
    def __init__(self):
        self.calls = []

    def on_output(self, rid, token_ids, finish_reason, error, **extra):
        self.calls.append((rid, list(token_ids), finish_reason, error))


def _frontend():
    """Model "m": replica 0 on engines 0 -> 1, replica 1 on engine 2."""
    placement = SimpleNamespace(models={"m": SimpleNamespace(replicas=[[0, 1], [2]])})
    engines, lines = Engines(), []
    return Frontend(None, placement, engines, report=lines.append), engines, lines


def test_requests_go_to_the_least_outstanding_replica_and_tokens_to_their_sink():
    f, engines, _ = _frontend()
    sinks = {rid: Sink() for rid in "abc"}
    for rid in "abc":
        f.start(rid, "m", [1, 2], PARAMS, sinks[rid])
    assert [c[1] for c in engines.calls] == [0, 2, 0]  # first stages of replicas 0, 1, 0
    with pytest.raises(UserError, match="request_id: 'a' is already in use"):
        f.start("a", "m", [1], PARAMS, Sink())
    f.on_output("b", [5], None, None)
    f.on_output("b", [6], "length", None)
    f.on_output("b", [7], None, None)  # after the end: dropped
    assert sinks["b"].calls == [("b", [5], None, None), ("b", [6], "length", None)]
    assert f.dispatcher.outstanding("m") == [2, 0] and not f.is_live("b")


def test_an_abort_frees_every_stage_of_the_replica_and_ends_the_stream():
    f, engines, _ = _frontend()
    sink = Sink()
    f.start("a", "m", [1], PARAMS, sink)
    f.end("a", "gone")
    f.end("a")  # unknown now: ignored
    assert engines.calls[1:] == [("free", 0, ["a"]), ("free", 1, ["a"])]
    assert sink.calls == [("a", [], "abort", "gone")] and f.dispatcher.outstanding("m") == [0, 0]


def test_a_preempted_request_restarts_from_its_tokens_after_another_request_of_its_replica_ends():
    f, engines, lines = _frontend()
    for rid in "abc":  # a and c on replica 0
        f.start(rid, "m", [1, 2], PARAMS, Sink())
    f.on_output("c", [8, 9], None, None)
    f.preempt("c", "stall")
    assert f.held() == {"m": 1} and f.preemptions() == {"m": 1}
    assert engines.calls[3:] == [("free", 0, ["c"]), ("free", 1, ["c"])]
    assert lines == ["request c stopped to free KV; it restarts by recompute after 2 token(s)"]
    f.on_output("c", [10], None, None)  # the stopped run's late output: dropped
    f.on_output("a", [4], "stop", None)  # a frees KV on replica 0: c goes back
    assert engines.calls[5:] == [("add", 0, "c#recompute1", [1, 2, 8, 9], 8)]
    assert f.held() == {} and f.live["c"].output == [8, 9]
    f.on_output("c#recompute1", [11], "length", None)
    assert list(f.live) == ["b"] and f.dispatcher.outstanding("m") == [0, 1]


def test_an_engine_going_down_fails_its_replicas_requests_and_frees_them_on_the_others():
    f, engines, lines = _frontend()
    sinks = [Sink(), Sink()]
    f.start("a", "m", [1], PARAMS, sinks[0])  # replica 0
    f.start("b", "m", [1], PARAMS, sinks[1])  # replica 1
    f.on_output("b", [3], "stop", None)
    f.mark_down(1, "engine 1 died")
    f.mark_down(1, "engine 1 died again")  # already down: nothing more
    assert sinks[0].calls == [("a", [], "abort", "engine 1 died")] and len(sinks[1].calls) == 1
    assert engines.calls[2:] == [("free", 0, ["a"])]  # not on the dead engine
    assert lines == ["engine 1 died; failing 1 request(s) on its replicas"]
    assert f.live_replicas("m") == 1
    f.start("c", "m", [1], PARAMS, Sink())
    assert engines.calls[-1][1] == 2  # the live replica, though replica 0 comes first on a tie
    assert f.dispatcher.outstanding("m") == [0, 1]
    f.mark_down(2, "engine 2 died")
    with pytest.raises(Unavailable, match=r"no live replica: engine 1 dead \(engine 1 died\); engine 2 dead"):
        f.start("d", "m", [1], PARAMS, Sink())
    f.mark_up(1)
    f.start("d", "m", [1], PARAMS, Sink())
    assert engines.calls[-1][1] == 0 and f.down_engines() == {2: "engine 2 died"}


def test_a_failure_ends_every_request_even_past_a_broken_sink():
    f, _, _ = _frontend()

    class Broken:
        def on_output(self, *args, **kwargs):
            raise RuntimeError("sink bug")

    good = Sink()
    f.start("a", "m", [1], PARAMS, Broken())
    f.start("b", "m", [1], PARAMS, good)
    f.fail_all("router failed")
    assert good.calls == [("b", [], "abort", "router failed")] and f.live == {}


def test_the_package_imports_no_torch_or_ray_and_resolves_llmcluster_on_use():
    code = ("import sys, paraflex.serving as s; heavy = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "from paraflex.serving.in_process import LLMCluster; "
            "print(heavy, s.LLMCluster is LLMCluster)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"


def test_a_dead_replica_with_fewer_outstanding_requests_is_never_picked():
    placement = SimpleNamespace(models={"m": SimpleNamespace(replicas=[[0], [1]])})
    engines = Engines()
    f = Frontend(None, placement, engines, report=lambda line: None)
    for rid in "abc":  # replicas 0, 1, 0
        f.start(rid, "m", [1], PARAMS, Sink())
    f.mark_down(1, "engine 1 died")  # replica 1 now has 0 outstanding, the live one 2
    f.start("d", "m", [1], PARAMS, Sink())
    assert [c[1] for c in engines.calls if c[0] == "add"][-1] == 0
    assert f.dispatcher.outstanding("m") == [3, 0]
