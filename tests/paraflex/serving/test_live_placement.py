"""Live placement changes on the in-process backend (paraflex/serving/live_placement.py): a
replica of a model added and another removed while streams run at it, nothing lost; refusals
(another config 400, cannot fit 409, dead engine 503, another cut 409) change nothing; a failed
action rolls back and the old placement serves."""

import threading

import pytest
import torch
from live_placement_case import KV, NEW, OLD, live_config as _config, placement
from stream_sink import StreamSink

from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.in_process_backend import InProcessBackend
from paraflex.serving.in_process_stages import InProcessStages
from paraflex.serving.live_placement import PlacementRejected, check_placement

torch.set_num_threads(1)

PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture
def backend():
    b = InProcessBackend(LLMCluster(_config(), placement(OLD, 3, KV), kv_bytes=KV))
    yield b
    b.cluster.shutdown()


def _submit(cluster, n, tag):
    sinks = {}
    for i in range(n):
        sinks[f"{tag}{i}"] = s = StreamSink()
        cluster.submit("tiny-2l", [256, 10 + i, 20 + i], PARAMS, request_id=f"{tag}{i}", sink=s)
    return sinks


def _resident(cluster, engine):
    return {st.model for st in cluster.engine_handles.loop_of(engine).scheduler.stages}


def test_a_replica_added_and_another_removed_while_streams_run_loses_nothing(backend, caplog):
    cluster = backend.cluster
    reference = [r.token_ids for r in cluster.generate("tiny-2l", [[256, 10 + i, 20 + i] for i in range(8)], PARAMS)]
    backend.changer.drain_timeout_s = 0.0  # the requests still on the removed replica: moved by recompute
    before = _submit(cluster, 8, "a")
    result = {}
    change = threading.Thread(target=lambda: result.update(backend.change_placement(placement(NEW, 3, KV))))
    with caplog.at_level("INFO"):
        change.start()
        during = {}
        while change.is_alive() or len(during) < 4:  # streams start while the change is under way, and after
            during.update(_submit(cluster, 1, f"b{len(during)}-"))
            change.join(0.005)
    report = result
    sinks = {**before, **during}
    for s in sinks.values():
        assert s.done.wait(60)
    for rid, s in sinks.items():
        assert s.end == ("length", None), rid
        assert len(s.tokens) == PARAMS.max_tokens, rid
    assert "moved off its replica on engines [2]; they restart by recompute" in caplog.text
    # greedy: a request moved mid-stream by recompute goes on with the very tokens it would have had
    assert [s.tokens for s in before.values()] == reference
    assert [(a["op"], a["model"], a["engines"]) for a in report["actions"]] == [
        ("add", "tiny-2l", [1]), ("remove", "tiny-2l", [2])]
    assert report["moved_bytes"] == report["actions"][0]["weight_bytes"] > 0
    assert backend.placement().to_dict() == placement(NEW, 3, KV).to_dict()
    assert _resident(cluster, 1) == {"tiny-2l", "tiny-4l"} and _resident(cluster, 2) == {"tiny-4l"}
    # the new replica serves, the removed one freed everything
    assert cluster.generate("tiny-2l", [[256, 1, 2]], PARAMS, timeout_s=60)[0].finish_reason == "length"
    cluster.call_on_loop(lambda: None)
    for loop in cluster.engines:
        assert loop.scheduler.num_live == 0 and loop.scheduler.pool.num_used == 0
    m = backend.metrics()
    assert m.placement_actions == {("add", "done"): 1, ("remove", "done"): 1}
    assert m.placement_moved_bytes == report["moved_bytes"]


def test_a_failed_add_rolls_back_and_the_old_placement_serves(monkeypatch):
    # four engines: tiny-2l on 0 and 3, tiny-4l on 1 -> 2. The change adds tiny-2l on 1 and
    # tiny-4l on 3 -> 0 (both before any removal), then would remove tiny-2l from 3.
    old = {"tiny-2l": (2, [(0, 2)], [[0], [3]]), "tiny-4l": (4, [(0, 2), (2, 4)], [[1, 2]])}
    new = {"tiny-2l": (2, [(0, 2)], [[0], [1]]), "tiny-4l": (4, [(0, 2), (2, 4)], [[1, 2], [3, 0]])}
    backend = InProcessBackend(LLMCluster(_config(4), placement(old, 4, KV), kv_bytes=KV))
    cluster = backend.cluster
    real = InProcessStages.load_stage

    def fail_on_engine_0(self, engine, model, *args):
        if engine == 0:
            raise OSError("disk gone")
        real(self, engine, model, *args)

    monkeypatch.setattr(InProcessStages, "load_stage", fail_on_engine_0)
    try:
        sinks = _submit(cluster, 4, "r")
        with pytest.raises(PlacementRejected, match="could not add replica 1 of tiny-4l.*disk gone.*rolled back 1") as err:
            backend.change_placement(placement(new, 4, KV))
        assert err.value.status == 500
        assert backend.placement().to_dict() == placement(old, 4, KV).to_dict()
        # the loaded stage of the failed replica (engine 3) and the added replica (engine 1) are gone
        assert [_resident(cluster, e) for e in range(4)] == [{"tiny-2l"}, {"tiny-4l"}, {"tiny-4l"}, {"tiny-2l"}]
        for s in sinks.values():
            assert s.done.wait(60) and s.end == ("length", None) and len(s.tokens) == PARAMS.max_tokens
        assert cluster.generate("tiny-4l", [[256, 3]], PARAMS, timeout_s=60)[0].finish_reason == "length"
        assert backend.metrics().placement_actions == {("add", "done"): 1, ("add", "failed"): 1,
                                                       ("add", "rolled_back"): 1}
    finally:
        cluster.shutdown()


def test_refusals_change_nothing(backend):
    old = backend.placement().to_dict()
    other = Config.from_dict({
        "cluster": {"num_engines": 3, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}]}, source="other")
    with pytest.raises(PlacementRejected, match="places models tiny-2l, tiny-4l but other") as err:
        check_placement(other, placement(NEW, 3, KV))
    assert err.value.status == 400
    with pytest.raises(PlacementRejected, match="places models") as err:
        backend.change_placement(placement({"tiny-2l": OLD["tiny-2l"]}, 3, KV))
    assert err.value.status == 400
    with pytest.raises(PlacementRejected, match="cannot fit: \\(5\\): engine 0") as err:
        backend.change_placement(placement(NEW, 3, 2 << 30))
    assert err.value.status == 409
    with pytest.raises(PlacementRejected, match="cuts it into other stages") as err:
        backend.change_placement(placement({**NEW, "tiny-4l": (4, [(0, 1), (1, 4)], [[1, 2]])}, 3, KV))
    assert err.value.status == 409
    backend.cluster.frontend.mark_down(1, "engine 1 died (test)")
    with pytest.raises(PlacementRejected, match="engine 1 is dead") as err:
        backend.change_placement(placement(NEW, 3, KV))
    assert err.value.status == 503
    backend.cluster.frontend.mark_up(1)
    assert backend.placement().to_dict() == old
    assert backend.metrics().placement_actions == {}


def test_a_model_left_without_a_replica_in_between_is_refused(backend):
    # tiny-4l's only replica 1 -> 2 becomes 2 -> 1: both engines hold a stage of it already
    new = placement({**OLD, "tiny-4l": (4, [(0, 2), (2, 4)], [[2, 1]])}, 3, KV)
    with pytest.raises(PlacementRejected, match="tiny-4l: every replica moves onto engines") as err:
        backend.change_placement(new)
    assert err.value.status == 409


def test_a_removed_replica_drops_its_stages_before_its_process_group(backend, monkeypatch):
    """A Ray engine still stepping a leftover batch of the model sends into its replica's group:
    the group may go only once every stage of the replica has left its engine."""
    calls = []
    for name in ("unload_stage", "leave_replica"):
        real = getattr(InProcessStages, name)
        monkeypatch.setattr(InProcessStages, name,
                            lambda self, *args, _real=real, _name=name: calls.append((_name, args[0])) or _real(self, *args))
    backend.change_placement(placement(NEW, 3, KV))
    assert calls == [("unload_stage", 2), ("leave_replica", "tiny-2l")]
