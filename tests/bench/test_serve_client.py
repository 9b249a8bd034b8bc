"""bench/serve_client.py's quiet wait (a round starts once the machine is idle) and
bench/call_probe.py's events (no tensor kept alive by a timer)."""

from __future__ import annotations

import sys
import threading
import time
import weakref

import pytest
from repo_paths import load_bench

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@linux_only
def test_busy_cores_count_a_spinning_thread():
    client = load_bench("serve_client")
    _, mark = client.busy_cores_since()
    spin(0.5)
    busy, _ = client.busy_cores_since(mark)
    assert busy >= 0.5  # this thread alone kept one core busy (others may add to it)


@linux_only
def test_wait_quiet_waits_out_a_busy_neighbour_and_gives_up_at_its_limit():
    client = load_bench("serve_client")
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            spin(0.01)

    worker = threading.Thread(target=burn)
    worker.start()
    try:
        waited = client.wait_quiet(max_s=0.6, below_cores=0.9)  # one core stays busy throughout
    finally:
        stop.set()
        worker.join()
    assert waited >= 0.6
    assert client.wait_quiet(max_s=0.6, below_cores=float("inf")) < 0.6  # any load counts as quiet


def test_probe_keeps_scalar_arguments_and_drops_objects():
    probe_mod = load_bench("call_probe")

    class Payload:
        pass

    class Target:
        def call(self, arg):
            return arg

    probe = probe_mod.Probe()
    probe.wrap(Target, "call", "call")
    try:
        payload = Payload()
        alive = weakref.ref(payload)
        Target().call(payload)
        Target().call("request-7")
        del payload
        assert alive() is None  # the timer kept no reference to a non-scalar argument
        assert [event[3] for event in probe.events] == [None, "request-7"]
    finally:
        probe.restore()
