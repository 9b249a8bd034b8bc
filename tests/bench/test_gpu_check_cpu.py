"""bench/gpu_check.py runs end to end on CPU with tiny shapes (`--device cpu --tiny`): every part
finishes without error, the JSON holds each part's results, float32 greedy tokens match
`transformers`, and the table is printed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = results["parts"]
    assert sorted(parts) == ["1_kernels_and_twins", "2_greedy_vs_transformers", "3_speed_7b_shape",
                             "4_pipeline_workload"]
    assert all(p["status"] == "done" for p in parts.values()), {k: p.get("error") for k, p in parts.items()}
    assert all(k["ok"] for k in parts["1_kernels_and_twins"]["result"]["kernels"])
    assert parts["2_greedy_vs_transformers"]["result"]["fp32_all_identical"]
    speed = parts["3_speed_7b_shape"]["result"]
    assert speed["decode"] and all(d["step_ms"] > 0 for d in speed["decode"])
    serve = parts["4_pipeline_workload"]["result"]
    assert serve["finished"] == serve["requests"] and serve["errors"] == 0
    assert "2_greedy_vs_transformers: done" in proc.stdout and "TTFT p50" in proc.stdout
