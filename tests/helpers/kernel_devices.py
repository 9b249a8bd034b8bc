"""Where the Triton kernel tests run: on CPU tensors under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 where no GPU is visible), and compiled on CUDA as `gpu`-marked twins."""

from __future__ import annotations

import os

import pytest
import torch

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the Triton interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param("cpu", marks=interpreted),
           pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
