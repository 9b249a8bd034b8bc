"""The files shipped inside the package: the demo config and the Splitwise traces by short name."""

import os

from paraflex.shipped import TRACES, demo_config_path, trace_path
from paraflex.simulator.workload.trace import load_trace


def test_demo_config_is_shipped():
    assert os.path.basename(demo_config_path()) == "demo.yaml"


def test_shipped_traces_load_by_short_name_with_their_licence():
    for name in TRACES:
        path = trace_path(name)
        assert load_trace(path)
        assert os.path.isfile(os.path.join(os.path.dirname(path), "LICENSE"))


def test_a_trace_path_passes_through():
    assert trace_path("my/trace.csv") == "my/trace.csv"


def test_demo_cuts_a_model_over_engines_that_hold_several_models():
    """The demo shows what ParaFlex is: a model in >= 2 stages on different engines, and engines
    holding stages of several models."""
    from paraflex.config.schema import load_config
    from paraflex.planner import plan

    placement = plan(load_config(demo_config_path()))
    cut = [mp for mp in placement.models.values() if mp.num_stages >= 2]
    assert cut and all(len(set(route)) == len(route) for mp in cut for route in mp.replicas)
    assert all(len({ref.model for ref in ep.stages}) >= 2 for ep in placement.engines)
