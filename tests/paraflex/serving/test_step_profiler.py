"""paraflex/serving/step_profiler.py with the probe set a GPU gets (packed prompts, long
contexts), run on a CPU on a tiny model: every residual term comes out finite, the per-prompt and
per-context terms are never negative, and the probes of each group ran. No timing comparison."""

from __future__ import annotations

import math

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.serving import step_profiler


def test_gpu_probe_set_fits_every_term(monkeypatch):
    monkeypatch.setitem(step_profiler.PROBE_SIZES, "cpu", ((8, 16, 32), (1, 2, 4), (2, 3), (1, 2)))
    monkeypatch.setattr(step_profiler, "LONG_CONTEXT", 48)
    monkeypatch.setattr(step_profiler, "PACKED_PROMPT", 8)
    config = Config.from_dict({"cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1},
                               "models": [{"name": "m", "arch": "tiny-2l"}],
                               "scheduler": {"max_batch_size": 4, "block_bytes": 4096}})
    lines = []
    (entry,), noise = step_profiler.measure_steps(config, ["m"], CostModel("cpu"), repeats=3, progress=lines.append)
    fields = entry.to_dict()
    assert all(math.isfinite(fields[k]) for k in fields if k.endswith("_s"))
    assert entry.prefill_per_extra_seq_s >= 0 and entry.decode_per_context_s >= 0
    assert any("2 packed prompts" in line for line in lines) and any("context 53" in line for line in lines)
    assert 0 <= noise["m"].prefill_spread and 0 <= noise["m"].decode_spread
