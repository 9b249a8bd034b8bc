"""`find_min_engines`: the fewest engines meeting a target attainment, by bisection, with a
progress bar; a system that cannot lay out the models on n engines fails at n."""

from __future__ import annotations

import io

import pytest

from paraflex.config.schema import Config
from paraflex.errors import UserError
from paraflex.simulator.min_engines import find_min_engines
from paraflex.simulator.runner import SimSettings


def config(engines: int) -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": engines, "device": "h100-80g", "memory_gb": 72, "host_memory_gb": 512},
        "models": [{"name": f"m{i}", "arch": "llama-2-7b", "slo_ttft_ms": 2000, "slo_tbt_ms": 50} for i in range(4)],
        "workload": {"arrival": "poisson", "duration_s": 15, "zipf_alpha": 1.0},
    })


def test_fewest_engines_for_muxserve():
    out = io.StringIO()
    best, tries = find_min_engines(config(4), SimSettings(system="muxserve", rate=2.0), 0.9, "ttft", stream=out)
    assert best == 2  # 4 models, at most 2 per engine: 1 engine cannot lay them out
    assert tries[1][0] == 0.0 and "no layout" in tries[1][1]
    assert tries[2][0] >= 0.9
    assert "fewest engines for ttft >= 0.9" in out.getvalue()


def test_target_not_met_and_bad_target():
    best, tries = find_min_engines(config(1), SimSettings(system="muxserve", rate=2.0), 0.5, stream=io.StringIO())
    assert best is None and list(tries) == [1]
    with pytest.raises(UserError, match="fraction"):
        find_min_engines(config(2), SimSettings(system="muxserve"), 99, stream=io.StringIO())
