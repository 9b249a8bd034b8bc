"""Test helper: a two-node Ray cluster on this machine (a head and one worker node, each with
its own CPUs and a `paraflex_node_<k>` resource), run as a script in its own process so it
never meets the test session's Ray instance.

`python two_node_ray.py TEMP_DIR CPUS_PER_NODE` starts the nodes (Ray's `Cluster` test
utility, state under TEMP_DIR), prints one JSON line {"address", "nodes": [node ids, head
first], "pids": [every process the nodes started]}, then waits for its stdin to close (the
test closes it, or dies) and shuts the nodes down. `TwoNodeRay` in a test runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(temp_dir: str, cpus: int) -> None:
    os.environ["RAY_TMPDIR"] = temp_dir  # (Ray's cluster-address file goes there, not /tmp/ray)
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    args = {"num_cpus": cpus, "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster()
    try:
        cluster.add_node(**args, resources={"paraflex_node_0": 1})  # the head
        worker = cluster.add_node(**args, resources={"paraflex_node_1": 1})
        nodes = [cluster.head_node.node_id, worker.node_id]
        pids = sorted({p.process.pid for n in (cluster.head_node, worker)
                       for infos in n.all_processes.values() for p in infos})
        print(json.dumps({"address": cluster.address, "nodes": nodes, "pids": pids}), flush=True)
        sys.stdin.read()  # until the test closes it
    finally:
        cluster.shutdown()


class TwoNodeRay:
    """The helper script as a context manager: `.address`, `.nodes`, `.pids`; on exit the
    script shuts its nodes down and ends (killed, by its PID, after `timeout_s`)."""

    def __init__(self, temp_dir: str, cpus: int, env: dict | None = None, timeout_s: float = 60.0) -> None:
        self.args = [sys.executable, __file__, temp_dir, str(cpus)]
        self.env = env  # e.g. RAY_AUTH_MODE=token with RAY_AUTH_TOKEN: the nodes then require the token
        self.timeout_s = timeout_s

    def __enter__(self) -> "TwoNodeRay":
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(self.timeout_s)
            raise RuntimeError(f"the two-node Ray cluster did not start (exit {self.proc.returncode})")
        info = json.loads(line)
        self.address, self.nodes, self.pids = info["address"], info["nodes"], info["pids"]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
