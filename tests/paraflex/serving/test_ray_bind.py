"""Exposure of the Ray serving path: what `paraflex serve` starts listens on loopback when its
gateway does, and the process groups' rendezvous store listens on the host it is given only."""

from __future__ import annotations

import os

import pytest

from paraflex.engine.transport.ray_groups import is_loopback, start_store
from paraflex.serving.ray_startup import bind_host


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False),
])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_a_local_ray_binds_to_loopback_only_when_the_gateway_does():
    assert bind_host("127.0.0.1", starts_local_ray=True) == "127.0.0.1"
    assert bind_host("localhost", starts_local_ray=True) == "127.0.0.1"
    assert bind_host("0.0.0.0", starts_local_ray=True) is None  # the node's address, as Ray picks it
    assert bind_host("127.0.0.1", starts_local_ray=False) is None  # joining a cluster: its address
    assert bind_host(None, starts_local_ray=True) is None


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) with a socket listening on port."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                out.append(address)
    return out


def test_the_store_listens_on_the_given_host_only_and_serves_keys():
    import datetime

    import torch.distributed as dist

    store, port = start_store("127.0.0.1")
    try:
        assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not every interface
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert store.get("key") == b"value"
    finally:
        del store


LOCAL_RAY_LISTENERS = r'''
import json, os, sys, time
import ray
from paraflex.serving.ray_startup import keep_ray_on_loopback

keep_ray_on_loopback()
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
         _temp_dir=sys.argv[1], _node_ip_address="127.0.0.1")


@ray.remote
class Echo:
    def ping(self):
        return 1


ray.get(Echo.remote().ping.remote())  # a core worker (an engine actor's kind) is up
time.sleep(1)
listening = {}
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # LISTEN
            listening[fields[9]] = fields[1].split(":")[0]
parents = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        parents[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        pass


def descends(pid):
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = parents.get(pid, 0)
    return False


found = []
for pid in [p for p in parents if descends(p)]:
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        continue
    found += [listening[link[8:-1]] for link in links if link.startswith("socket:[") and link[8:-1] in listening]
ray.shutdown()
print(json.dumps(found))
'''

LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_a_local_ray_kept_on_loopback_listens_on_loopback_only(tmp_path):
    """The GCS, raylet, driver, an actor's core worker and the dashboard agent of a local Ray
    (in a subprocess: the tests' own Ray instance is already up) listen on 127.0.0.1 only."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    script = tmp_path / "local_ray.py"
    script.write_text(LOCAL_RAY_LISTENERS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    ray_dir = tempfile.mkdtemp(prefix="pfx-ray-")  # short: Ray's socket paths live under it
    try:
        done = subprocess.run([sys.executable, str(script), ray_dir], capture_output=True, text=True,
                              timeout=240, env=env)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) >= 5  # GCS, raylet (2), driver, the actor's core worker, agents
    assert set(found) <= LOOPBACK_HEX, found
