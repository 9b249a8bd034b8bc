"""bench/vllm_peer.py: holding the vLLM peer to AVX2 when the run holds torch there."""

import os
import shutil
import subprocess
import sys

from repo_paths import load_bench

vllm_peer = load_bench("vllm_peer")


def test_only_a_run_held_to_avx2_holds_the_peer():
    assert vllm_peer.held_to_avx2({"ATEN_CPU_CAPABILITY": "avx2"})
    assert vllm_peer.held_to_avx2({"ATEN_CPU_CAPABILITY": "AVX2"})
    assert not vllm_peer.held_to_avx2({"ATEN_CPU_CAPABILITY": "avx512"})
    assert not vllm_peer.held_to_avx2({})


def test_processes_started_with_the_held_environment_see_no_avx512():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    folder = vllm_peer.hold_to_avx2(env)
    try:
        assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        probe = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), " \
                "torch.backends.cpu.get_cpu_capability())"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False", "False", "AVX2"]
    finally:
        shutil.rmtree(folder)
