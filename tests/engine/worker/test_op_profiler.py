"""engine/worker/op_profiler.py: one row per token count with a median for every op, ops that cost
no less at more tokens, and on CUDA ops timed inside a CUDA graph (replayed, as decode steps run
them). No timing comparison: only that the samples are real, positive and complete."""

from __future__ import annotations

import math

import pytest
import torch

from paraflex.costs.profile_tables import ALL_OPS
from paraflex.engine.worker import op_profiler
from paraflex.models.catalog import get_arch

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_every_op_has_a_positive_median_that_does_not_fall_with_tokens(device):
    arch = get_arch("tiny-2l")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    result = op_profiler.profile_layer_ops(arch, torch.device(device), dtype, tokens=(1, 8, 64), repeats=3)
    assert [row["num_tokens"] for row in result.rows] == [1, 8, 64]
    for op in ALL_OPS:
        medians = [row[f"time_stats.{op}.median"] for row in result.rows]
        assert all(math.isfinite(m) and m > 0 for m in medians), op
        assert medians == sorted(medians), op  # pooled to stay monotone in tokens

