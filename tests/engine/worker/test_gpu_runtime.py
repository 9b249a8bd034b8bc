"""CUDA twins of the runtime oracle: greedy tokens equal `transformers` with the Triton kernels
and the decode CUDA graphs in the loop (float32), graphs change no token, swapping on CUDA stays
exact, and hidden states travel between in-process engines without leaving the GPU. The CPU
logic of each part has its own test (tests/test_runtime_oracle.py, tests/engine/kernels/)."""

import pytest
import torch
from oracle_models import build_llama, build_qwen2, hf_greedy, make_config, make_placement

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 67)), [3]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-gpu")
    return d, build_llama(d, num_layers=3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-gpu")
    return d, build_qwen2(d, num_layers=5)


def _cluster(dirs, layout, engines, **kw):
    return LLMCluster(make_config(dirs, engines), make_placement(layout, engines), device="cuda",
                      dtype="float32", kv_bytes=64 << 20, **kw)  # room for the decode graphs' reserve


@pytest.mark.parametrize("cuts,route", [([(0, 3)], [0]), ([(0, 2), (2, 3)], [0, 1]),
                                        ([(0, 1), (1, 2), (2, 3)], [2, 0, 1])])
def test_llama_greedy_matches_transformers_with_graphs(llama, cuts, route):
    d, model = llama
    cluster = _cluster({"llama": d}, {"llama": (3, cuts, [route])}, len(route))
    assert all(e.worker.graphs for e in cluster.engines)  # decode steps replay captured graphs
    results = cluster.generate("llama", PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def test_two_models_share_engines_and_graphs_change_no_token(llama, qwen, monkeypatch):
    (dl, ml), (dq, mq) = llama, qwen
    layout = {"llama": (3, [(0, 2), (2, 3)], [[0, 1]]), "qwen": (5, [(0, 2), (2, 4), (4, 5)], [[1, 2, 0]])}
    sent = []
    with_graphs = _cluster({"llama": dl, "qwen": dq}, layout, 3)
    send = with_graphs.hub.send
    with_graphs.hub.send = lambda env: (sent.extend((env.tensors or {}).values()), send(env))
    got = {m: [r.token_ids for r in with_graphs.generate(m, PROMPTS, GREEDY)] for m in ("llama", "qwen")}
    assert got["llama"] == [hf_greedy(ml, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got["qwen"] == [hf_greedy(mq, p, GREEDY.max_tokens) for p in PROMPTS]
    assert sent and all(t.is_cuda for t in sent)  # hidden states stay on the device between engines
    monkeypatch.setenv("PARAFLEX_CUDA_GRAPHS", "0")
    eager = _cluster({"llama": dl, "qwen": dq}, layout, 3)
    assert not any(e.worker.graphs for e in eager.engines)
    assert {m: [r.token_ids for r in eager.generate(m, PROMPTS, GREEDY)] for m in got} == got


def test_tiny_pool_swaps_on_cuda_and_stays_exact(llama):
    d, model = llama
    prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    cfg = make_config({"llama": d}, 2, block_bytes=2048)
    cluster = LLMCluster(cfg, make_placement({"llama": (3, [(0, 2), (2, 3)], [[0, 1]])}, 2), device="cuda",
                         dtype="float32", kv_bytes=24 * 2048, host_kv_bytes=200 * 2048)
    results = cluster.generate("llama", prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 30) for p in prompts]
