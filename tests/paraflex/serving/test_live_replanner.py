"""Live re-planning in the server (paraflex/serving/live_replanner.py) on the in-process backend:
the traffic of one model jumps, the re-planner moves a replica to it while its streams run, and
every request ends with all its tokens; balanced traffic keeps the placement."""

import threading

import pytest
import torch
from stream_sink import StreamSink

from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.planner import plan
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.in_process_backend import InProcessBackend
from paraflex.serving.live_replanner import LiveReplanner

torch.set_num_threads(1)

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
INTERVAL = 10.0


def tight_config() -> Config:
    """Three CPU engines of 2 MB: the planner gives tiny-2l two replicas and tiny-4l one for
    equal rates, and a replica of tiny-4l for one of tiny-2l when tiny-4l's traffic dominates.
    Alg. 1's shares by stage count (the paper's eq. 7: equal rates, equal shares, the tie to the
    first model); by work (the default) tiny-4l would start with the two replicas."""
    return Config.from_dict({
        "cluster": {"num_engines": 3, "device": "cpu", "memory_gb": 0.002, "host_memory_gb": 0.05},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l", "stages": 1, "rate": 1},
                   {"name": "tiny-4l", "arch": "tiny-4l", "stages": 1, "rate": 1}],
        "scheduler": {"block_bytes": 4096, "max_batch_size": 4},
        "planner": {"kappa_gb": 0.0002, "replica_shares": "stages"},
    }, source="replan-test")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def served():
    config = tight_config()
    backend = InProcessBackend(LLMCluster(config, plan(config)))
    clock = Clock()
    lines = []
    replanner = LiveReplanner(backend, config, INTERVAL, 0.5, 0.1, clock=clock, report=lines.append)
    yield backend, replanner, clock, lines
    backend.cluster.shutdown()


def _arrive(backend, replanner, clock, model, n, until, sinks=None, tag=""):
    """`n` arrivals of `model` spread up to `until`, each a stream when `sinks` is given (what the
    gateway does: observe, then submit)."""
    start = clock.now
    for i in range(n):
        clock.now = start + (until - start) * (i + 1) / n
        replanner.observe(model)
        if sinks is not None:
            rid = f"{tag}{len(sinks)}"
            sinks[rid] = s = StreamSink()
            backend.cluster.submit(model, [256, 10 + i, 20 + i], PARAMS, request_id=rid, sink=s)


def test_a_model_whose_traffic_jumps_gets_a_replica_while_its_streams_run(served):
    backend, replanner, clock, lines = served
    assert [len(m.replicas) for m in backend.placement().models.values()] == [2, 1]
    _arrive(backend, replanner, clock, "tiny-2l", 20, INTERVAL)
    assert replanner.tick() is None  # the first window: the rates jumps are measured from
    sinks = {}
    _arrive(backend, replanner, clock, "tiny-4l", 60, 2 * INTERVAL, sinks, "a")  # tiny-4l's traffic jumps
    assert replanner.rates()["tiny-4l"] == pytest.approx(6.0)
    backend.changer.drain_timeout_s = 0.0  # requests on a removed replica: moved by recompute
    result = {}
    change = threading.Thread(target=lambda: result.update(replanner.tick() or {}))
    change.start()
    during = 0
    while change.is_alive() or during < 4:  # streams start while the change is under way, and after
        sink = sinks[f"b{during}"] = StreamSink()
        backend.cluster.submit("tiny-4l", [256, 7, during], PARAMS, request_id=f"b{during}", sink=sink)
        during += 1
        change.join(0.01)
    for s in sinks.values():
        assert s.done.wait(120)
    for rid, s in sinks.items():
        assert s.end == ("length", None), rid
        assert len(s.tokens) == PARAMS.max_tokens, rid
    assert [(a["op"], a["model"]) for a in result["actions"]] == [("add", "tiny-4l"), ("remove", "tiny-2l")]
    models = backend.placement().models
    assert (len(models["tiny-2l"].replicas), len(models["tiny-4l"].replicas)) == (1, 2)
    assert any(line.startswith("re-planning (interval") for line in lines)
    assert replanner.applied == [result]


def test_balanced_traffic_keeps_the_placement(served):
    backend, replanner, clock, lines = served
    before = backend.placement().to_dict()
    for k in range(1, 4):
        _arrive(backend, replanner, clock, "tiny-2l", 10, k * INTERVAL)
        _arrive(backend, replanner, clock, "tiny-4l", 10, k * INTERVAL)
        assert replanner.tick() is None
    assert backend.placement().to_dict() == before and not replanner.applied


def test_a_plan_that_cannot_be_made_is_reported_once_per_interval(served, monkeypatch):
    backend, replanner, clock, lines = served
    before = backend.placement().to_dict()

    def no_fit(current, rates):
        raise UserError("re-planning for rates ...: no feasible placement: test")

    monkeypatch.setattr(replanner.controller.planner, "replan", no_fit)
    for t in (INTERVAL, INTERVAL + 1, INTERVAL + 2):
        clock.now = t
        assert replanner.tick() is None
    assert [line for line in lines if "no feasible placement" in line] == [
        "re-planning: re-planning for rates ...: no feasible placement: test; the serving placement stays"]
    assert backend.placement().to_dict() == before
