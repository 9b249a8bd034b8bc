"""A last stage running a batch of prompt chunks that sample nothing (Sarathi's chunked
prefill with a token budget smaller than the prompt) returns no logits rows instead of
failing; the request then generates what `transformers` generates."""

import pytest
from oracle_models import build_llama, hf_greedy, make_placement

from paraflex.config.schema import Config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("stages", [[(0, 2)], [(0, 1), (1, 2)]])
def test_sarathi_chunks_smaller_than_the_prompt_of_a_lone_request(tmp_path, stages):
    model = build_llama(tmp_path, num_layers=2)
    config = Config.from_dict({
        "cluster": {"num_engines": len(stages), "device": "cpu", "memory_gb": 1.0},
        "models": [{"name": "llama", "hf": str(tmp_path)}],
        "scheduler": {"block_bytes": 4096, "policy": "sarathi", "prefill_token_budget": 4},
    })
    placement = make_placement({"llama": (2, stages, [list(range(len(stages)))])}, len(stages))
    prompt = list(range(20, 31))  # 11 tokens: chunks of 4, 4 and 3
    [result] = LLMCluster(config, placement).generate("llama", [prompt], GREEDY)
    assert result.error is None
    assert result.token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
