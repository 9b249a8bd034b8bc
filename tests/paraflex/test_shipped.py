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
