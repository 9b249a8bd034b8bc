"""`paraflex serve --ray-address` on a two-node Ray cluster started on this machine (a head and
a worker node, in their own processes: the test session's Ray instance is not involved).

The config puts 4 engines on 2 nodes (`cluster.nodes: 2`) and cuts tiny-4l into 4 stages, so
its one replica runs on engines 0-1-2-3 and its middle hop crosses from one node to the
other. The nodes require a token (RAY_AUTH_MODE=token), as docs/cluster.md sets them up.
Checked: each node's engines run on their own Ray node (the placement groups), the
engine -> node map in the start-up output and /health, a completed request through the
pipeline, and that SIGTERM and the cluster's shutdown leave none of the processes the test
started (by PID) alive.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
import time

import httpx
import pytest
import yaml

from serve_cli import read_until, serving
from two_node_ray import TwoNodeRay


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _config(path) -> str:
    cfg = {
        "cluster": {"num_engines": 4, "nodes": 2, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0.05},
        "models": [{"name": "pipe", "arch": "tiny-4l", "stages": 4}, {"name": "solo", "arch": "tiny-2l"}],
        "scheduler": {"max_batch_size": 4},
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_pipeline_across_two_ray_nodes_serves_and_shuts_down(tmp_path):
    # a short folder: Ray's unix sockets live under it (108-byte path limit)
    temp_dir = tempfile.mkdtemp(prefix="pf2n-", dir="/tmp")
    # token authentication as docs/cluster.md sets it up: every node and `paraflex serve` share the token
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    serve_pid = None
    try:
        with TwoNodeRay(temp_dir, cpus=2, env=env) as cluster:
            args = [_config(tmp_path / "two-nodes.yaml"), "--ray-address", cluster.address, "--port", "0",
                    "--drain-seconds", "0"]
            with serving(args, env=env) as (proc, lines):
                serve_pid = proc.pid
                out = read_until(lines, "/v1", timeout=150)
                url = next(line for line in out if "/v1" in line).split()[0].removesuffix("/v1")
                text = "".join(out)
                head, worker = cluster.nodes
                assert f"engines on nodes: 0-1 on node {head[:8]}" in text or f"0-1 on node {worker[:8]}" in text
                health = httpx.get(f"{url}/health", timeout=10).json()
                where = {e: n["node_id"] for e, n in health["nodes"].items()}
                assert where["0"] == where["1"] and where["2"] == where["3"] and where["1"] != where["2"]
                assert {where["0"], where["2"]} == {head, worker}
                done = httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": "pipe", "prompt": "hello", "max_tokens": 6, "ignore_eos": True}).json()
                assert done["usage"]["completion_tokens"] == 6, done
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 143  # (128 + SIGTERM, after stopping the engines)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in cluster.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in cluster.pids + [serve_pid] if _alive(p)] == []
        assert cluster.proc.returncode == 0
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
