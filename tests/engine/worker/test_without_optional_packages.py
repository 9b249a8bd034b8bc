"""The in-process path runs where Ray, pulp, gguf and the HTTP stack are not installed (as on a
GPU machine that has only torch and its neighbours): a child Python whose imports of those
packages fail plans, builds and runs an `LLMCluster` and `paraflex generate`, and the commands
that need a missing package say which in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from oracle_models import build_llama, hf_greedy, make_config

BLOCKED = ("ray", "pulp", "gguf", "fastapi", "uvicorn")
BLOCKER = f"""
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name.split(".")[0])
sys.meta_path.insert(0, _Missing())
"""
TESTS = Path(__file__).resolve().parents[2]


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", BLOCKER + code, *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-noext")
    return d, build_llama(d, num_layers=2)


@pytest.mark.slow
def test_llm_cluster_generates_without_optional_packages(llama, tmp_path):
    d, model = llama
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(make_config({"llama": d}, 2).to_dict()))
    code = """
import json, sys
from paraflex.config.schema import load_config
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.serving.in_process import LLMCluster
cluster = LLMCluster(load_config(sys.argv[1]), device="cpu")
out = cluster.generate("llama", [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
blocked = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"tokens": out[0].token_ids, "loaded": blocked}))
""" % (BLOCKED,)
    proc = _child(code, str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"tokens": hf_greedy(model, [5, 6, 7, 8], 6), "loaded": []}

    cli = "from paraflex.cli import main; sys.exit(main(sys.argv[1:]))"
    gen = _child(cli, "generate", str(config), "--model", "llama", "--prompt", "hello", "--max-tokens", "3",
                 "--device", "cpu", "--quiet")
    assert gen.returncode == 0, gen.stderr[-3000:]
    serve = _child(cli, "serve", str(config), "--in-process", "--port", "0")
    assert serve.returncode == 2 and "'fastapi' package is not installed" in serve.stderr
    assert len(serve.stderr.strip().splitlines()) == 1
    milp = _child(cli, "plan", str(config), "--solver", "milp", "-o", str(tmp_path / "p.json"))
    assert milp.returncode == 2 and "'pulp' package" in milp.stderr, milp.stderr
