"""With live re-planning on, the gateway feeds the re-planner's rate meter and /metrics shows
that meter's rates (one source of truth: what operators see is what the planner decides on)."""

import asyncio
import re

from fastapi.testclient import TestClient

from paraflex.config.schema import Config
from paraflex.gateway.app import build_app
from paraflex.planner import plan
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.in_process_backend import InProcessBackend
from paraflex.serving.live_replanner import LiveReplanner


def test_metrics_show_the_replanners_rates():
    config = Config.from_dict({
        "cluster": {"num_engines": 2, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}, {"name": "tiny-4l", "arch": "tiny-4l"}],
    }, source="replan-gateway-test")
    backend = InProcessBackend(LLMCluster(config, plan(config), kv_bytes=4 << 20))
    now = [0.0]
    replanner = LiveReplanner(backend, config, 20.0, 0.5, 0.1, clock=lambda: now[0])
    try:
        client = TestClient(build_app(backend, arrival_rates=replanner), base_url="http://localhost")
        for i in range(5):
            now[0] = 1.0 + i
            r = client.post("/v1/completions", json={"model": "tiny-2l", "prompt": f"x{i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    finally:
        asyncio.run(backend.close())
    assert replanner.rates() == {"tiny-2l": 5 / 20, "tiny-4l": 0.0}
    assert 'paraflex:arrival_rate{model_name="tiny-2l"} 0.25' in text
    assert 'paraflex:arrival_rate{model_name="tiny-4l"} 0.0' in text
    assert re.search(r"# HELP paraflex:arrival_rate .*arrivals in the last 20 s: the rates the live re-planner", text)
