"""The dtype an engine loads a model's stages in: the engine's --dtype, else the model config's
`dtype:`, else float32 on CPU."""

import pytest
import torch

from paraflex.config.schema import Config
from paraflex.engine.engine_builder import model_dtype
from paraflex.errors import UserError

CPU = torch.device("cpu")


def config(**model):
    return Config.from_dict({"cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1.0},
                             "models": [{"arch": "tiny-2l", **model}]})


def test_the_model_configs_dtype_is_the_default_and_an_explicit_engine_dtype_wins():
    bf16 = config(dtype="bfloat16").models[0]
    assert model_dtype(CPU, "auto", bf16) == torch.bfloat16
    assert model_dtype(CPU, None, bf16) == torch.bfloat16
    assert model_dtype(CPU, "float32", bf16) == torch.float32
    assert model_dtype(CPU, "auto", config().models[0]) == torch.float32
    assert bf16.to_dict(with_rate=False)["dtype"] == "bfloat16"  # a written plan keeps it


def test_float16_on_cpu_from_the_model_config_is_a_user_error():
    with pytest.raises(UserError, match="float16 is GPU-only"):
        model_dtype(CPU, "auto", config(dtype="float16").models[0])
