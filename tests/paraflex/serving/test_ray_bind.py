"""Exposure of the Ray serving path: what `paraflex serve` starts listens on loopback when its
gateway does, and the process groups' rendezvous store listens on the host it is given only."""

from __future__ import annotations

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
