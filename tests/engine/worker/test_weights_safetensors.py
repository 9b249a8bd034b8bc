"""Stage weights from HF safetensors directories: single file, sharded index, bad checkpoints,
and the demo models' deterministic random weights."""

import json

import pytest
import torch
from oracle_models import build_llama

from paraflex.models.arch_files import arch_from_hf_config
from paraflex.models.catalog import get_arch
from paraflex.engine.worker.weights import load_stage_weights, resolve_source
from paraflex.engine.worker.weights.names import stage_tensor_shapes
from paraflex.errors import UserError


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    build_llama(single, num_layers=5, seed=3)
    build_llama(sharded, num_layers=5, seed=3, max_shard_size="60KB")
    return single, sharded


def test_sharded_index_loads_the_same_tensors(checkpoints):
    single, sharded = checkpoints
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    arch = arch_from_hf_config(str(single))
    for a, b in [(0, 2), (2, 4), (4, 5)]:
        w1 = load_stage_weights(str(single), arch, a, b, source_kind="hf")
        w2 = load_stage_weights(str(sharded), arch, a, b, source_kind="hf")
        assert w1.keys() == w2.keys() == stage_tensor_shapes(arch, a, b).keys()
        assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_middle_stage_holds_no_embeddings_or_head(checkpoints):
    arch = arch_from_hf_config(str(checkpoints[0]))
    w = load_stage_weights(str(checkpoints[0]), arch, 2, 4, dtype=torch.bfloat16, source_kind="hf")
    assert {k.split(".")[2] for k in w} == {"2", "3"}
    assert all(t.dtype == torch.bfloat16 for t in w.values())


def test_checkpoint_that_does_not_match_its_config_is_a_user_error(checkpoints, tmp_path):
    arch = arch_from_hf_config(str(checkpoints[0]))
    wider = arch.__class__(**{**arch.to_dict(), "intermediate_size": arch.intermediate_size + 8})
    with pytest.raises(UserError, match="shape"):
        load_stage_weights(str(checkpoints[0]), wider, 0, 1, source_kind="hf")
    deeper = arch.__class__(**{**arch.to_dict(), "num_layers": 9})
    with pytest.raises(UserError, match="missing"):
        load_stage_weights(str(checkpoints[0]), deeper, 6, 9, source_kind="hf")
    with pytest.raises(UserError, match="model.safetensors"):
        load_stage_weights(str(tmp_path), arch, 0, 1, source_kind="hf")


def test_sources_resolve_or_explain():
    assert resolve_source("tiny-2l", "tiny-2l", "builtin") == ("random", "tiny-2l")
    with pytest.raises(UserError, match="hf: DIR"):
        resolve_source("llama-2-7b", "llama-2-7b", "builtin")
    with pytest.raises(UserError, match="does not exist"):
        resolve_source("/no/such/dir", "m", "hf")


def test_demo_random_weights_are_deterministic_per_name_and_tensor():
    arch = get_arch("tiny-4l")
    a = load_stage_weights("tiny-4l", arch, 0, 4)
    b = load_stage_weights("tiny-4l", arch, 2, 4)
    assert all(torch.equal(a[k], b[k]) for k in b if k in a)  # same tensors whatever the cut
    assert "model.embed_tokens.weight" not in b or arch.tie_embeddings
    other = load_stage_weights("tiny-2l", get_arch("tiny-2l"), 0, 2)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"][:8, :8],
                           other["model.layers.0.self_attn.q_proj.weight"][:8, :8])
