"""Swap counters for /metrics: a tiny KV pool with host swap space forces swapping, and the
in-process backend's metrics() (rendered as the gateway does) shows it per engine and per model."""

import asyncio

import torch
from oracle_models import make_placement

from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.gateway.metrics import GatewayMetrics
from paraflex.serving.backend import count_swapped
from paraflex.serving.in_process import LLMCluster
from paraflex.serving.in_process_backend import InProcessBackend

torch.set_num_threads(1)

BLOCK_BYTES = 2048


class Sink:
    def __init__(self):
        self.reason = None

    def on_output(self, rid, token_ids, finish_reason, error, **extra):
        self.reason = finish_reason or error


def test_a_request_swapped_on_two_stages_counts_once():
    assert count_swapped([{"a": ["r1", "r2"]}, {"a": ["r1"], "b": ["r3"]}, {}]) == {"a": 2, "b": 1}


def test_tiny_kv_pool_shows_swaps_in_metrics(monkeypatch):
    cfg = Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-2l", "arch": "tiny-2l"}],
        "scheduler": {"block_bytes": BLOCK_BYTES, "max_batch_size": 4},
    })
    pl = make_placement({"tiny-2l": (2, [(0, 2)], [[0]])}, 1)
    # 8 requests of 4 + 30 tokens need far more than the 24 device blocks: decode evicts to host
    cluster = LLMCluster(cfg, pl, kv_bytes=24 * BLOCK_BYTES, host_kv_bytes=200 * BLOCK_BYTES)
    monkeypatch.setattr(cluster, "start", lambda: None)  # this test steps the engines itself
    backend = InProcessBackend(cluster)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sinks = [Sink() for _ in range(8)]
    for i, sink in enumerate(sinks):
        cluster.submit("tiny-2l", [i + 1, i + 2, i + 3, i + 4], params, sink=sink)
    most_swapped = 0
    while cluster.has_unfinished():
        cluster.step()
        most_swapped = max(most_swapped, backend.metrics().swapped.get("tiny-2l", 0))
    assert [s.reason for s in sinks] == ["length"] * 8
    assert most_swapped > 0

    state = backend.metrics()
    swaps = state.swaps[0]
    assert swaps["swap_outs"] > 0 and swaps["swap_ins"] == swaps["swap_outs"]  # every one came back
    assert swaps["swap_out_bytes"] > 0 and swaps["swap_out_bytes"] % BLOCK_BYTES == 0
    assert swaps["swap_in_bytes"] == swaps["swap_out_bytes"]
    assert state.swapped == {}  # nothing is swapped once every request ended

    text = GatewayMetrics(["tiny-2l"]).render(state)
    assert f'paraflex:swap_outs_total{{engine="0"}} {float(swaps["swap_outs"])}' in text
    assert f'paraflex:swap_out_bytes_total{{engine="0"}} {float(swaps["swap_out_bytes"])}' in text
    assert 'vllm:num_requests_swapped{model_name="tiny-2l"} 0.0' in text
    asyncio.run(backend.close())
