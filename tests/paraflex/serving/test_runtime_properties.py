"""Property: whatever the stage cut, batch mix, batch size limit and KV pressure (swapping),
every request's greedy output equals that request run alone through one stage."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_models import make_placement

from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster

torch.set_num_threads(1)


def _config(num_engines, max_batch):
    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "tiny-4l", "arch": "tiny-4l"}],
        "scheduler": {"block_bytes": 1024, "max_batch_size": max_batch},  # 4 tokens per block
    })


@functools.lru_cache(maxsize=None)
def _alone():
    return LLMCluster(_config(1, 1), make_placement({"tiny-4l": (4, [(0, 4)], [[0]])}, 1), kv_bytes=1 << 20)


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return _alone().generate("tiny-4l", list(prompt), params)[0].token_ids


@pytest.mark.slow
@given(
    cut=st.sampled_from([[(0, 4)], [(0, 1), (1, 4)], [(0, 2), (2, 3), (3, 4)]]),
    reqs=st.lists(st.tuples(st.lists(st.integers(0, 255), min_size=1, max_size=12), st.integers(1, 10)),
                  min_size=1, max_size=6),
    max_batch=st.integers(1, 4),
    kv_blocks=st.integers(8, 24),  # blocks per layer: 6 needed by the longest request
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pipeline_output_is_independent_of_cut_batching_and_swapping(cut, reqs, max_batch, kv_blocks):
    n = len(cut)
    pl = make_placement({"tiny-4l": (4, cut, [list(range(n))])}, n)
    for eng, (a, b) in zip(pl.engines, cut):  # KV in proportion to the layers, as the planner does
        eng.kv_bytes["tiny-4l"] = kv_blocks * (b - a) * 1024
    cluster = LLMCluster(_config(n, max_batch), pl, host_kv_bytes=400 * 1024)
    sinks = []
    for prompt, max_tokens in reqs:
        sink = _Sink()
        cluster.submit("tiny-4l", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       sink=sink)
        sinks.append(sink)
    cluster.run_until_idle()
    for (prompt, max_tokens), sink in zip(reqs, sinks):
        assert sink.reason == "length"
        assert sink.tokens == _reference(tuple(prompt), max_tokens)
    for _ in range(3):
        cluster.step()
    for engine in cluster.engines:
        engine.scheduler.check()
        assert engine.scheduler.pool.num_used == 0 and engine.scheduler.pool.host_num_used == 0


class _Sink:
    def __init__(self):
        self.tokens, self.reason = [], None

    def on_output(self, rid, token_ids, finish_reason, error, **extra):
        assert error is None
        self.tokens += token_ids
        self.reason = finish_reason
