"""The Ray hop between two engine actors, measured: one source of truth for how a hop is timed.

Place in the data flow: `paraflex profile` calls `measure_hop` and stores the result in
profile.json (paraflex/costs/serving_terms.py), where the simulator and planner read it as the
link between engines of one node; `bench/hop_latency.py` builds on the same `HopActor` and `run_pair`
to compare the hop against the raw floor (a bare actor call plus a bare gloo send/recv).

Two actors hold a `RayTransport` each (paraflex.engine.transport.ray) and ping-pong envelopes
shaped like the engine core's batch messages; one hop = half a round trip. Each direction is a
stage-to-next-stage hop, as in serving: the model has two replicas, (0, 1) and (1, 0), and the
echo travels on the second.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import ray
import torch

from paraflex.engine.transport.base import Envelope
from paraflex.engine.transport.ray import GroupSpec, RayTransport, start_store
from paraflex.engine.transport.ray_slots import DEFAULT_SLOT_BYTES
from paraflex.engine.transport.ray_wire import encode_phase1

# name -> (rows, hidden): SmolLM2-135M width (576), fp32 as served on CPU.
CASES = {
    "token": (0, 576),        # metadata only (last stage -> first stage): phase 1 alone
    "decode1": (1, 576),      # decode, batch 1
    "decode32": (32, 576),    # decode, batch 32
    "prefill512": (512, 576),  # prefill of 512 tokens
}
MODEL = "bench"
LOCALHOST = "127.0.0.1"


def batch_meta(rows: int) -> dict:
    """Phase-1 metadata shaped like an engine-core decode batch message."""
    n = max(rows, 1)
    return {"batch": 0, "stage": 1, "replica": 0, "request_ids": [f"req-{i:06d}" for i in range(n)],
            "positions": list(range(100, 100 + n)), "new_tokens": [7] * n}


def envelope(src: int, dst: int, rows: int, hidden: int, batch_id: int) -> Envelope:
    meta = batch_meta(rows) | {"batch": batch_id}
    if rows == 0:
        return Envelope(src, dst, MODEL, "token", meta)
    t = torch.randn(rows, hidden)
    return Envelope(src, dst, MODEL, "batch", meta, {"hidden": t, "residual": t.clone()})


def tensor_bytes(rows: int, hidden: int) -> int:
    """Bytes of the hidden and residual states one envelope of `rows` rows carries (fp32)."""
    return 2 * rows * hidden * 4


@ray.remote(num_cpus=0.5)
class HopActor:
    """One endpoint: a RayTransport, plus the bare primitives the floor is made of."""

    def __init__(self, engine_id: int, slot_bytes: int) -> None:
        torch.set_num_threads(1)
        self.id = engine_id
        self.t = RayTransport(engine_id, slot_bytes=slot_bytes)
        self.peer = None
        self.event = threading.Event()
        self.result: list[float] | None = None

    def connect(self, peers, host, port) -> None:
        self.peer = peers[1 - self.id]
        self.t.connect(peers, [GroupSpec(MODEL, 0, (0, 1)), GroupSpec(MODEL, 1, (1, 0))], host, port)
        self.group = self.t.groups.get(MODEL, 0).pg

    def deliver(self, payload: bytes) -> None:
        self.t.deliver(payload)

    # -- bare actor call: A -> B.bare -> A.bare_back ------------------------------------------
    def bare(self, payload: bytes) -> None:
        self.peer.bare_back.remote(payload)

    def bare_back(self, payload: bytes) -> None:
        self.event.set()

    # -- the runs (on threads: a sync actor serves `deliver` only between calls) ----------
    def start(self, kind: str, iters: int, rows: int, hidden: int) -> None:
        self.result = None
        target = {"transport": self._run_transport, "actor": self._run_actor,
                  "gloo": self._run_gloo, "gloo_echo": self._gloo_echo,
                  "echo": self._echo}[kind]
        threading.Thread(target=target, args=(iters, rows, hidden), daemon=True).start()

    def poll(self):
        return self.result

    def _wait_one(self) -> Envelope:
        while True:
            got = self.t.recv_ready()
            if got:
                return got[0]
            self.t.wait(0.5)

    def _run_transport(self, iters, rows, hidden) -> None:
        times = []
        for i in range(iters):
            env = envelope(0, 1, rows, hidden, i)
            t0 = time.perf_counter()
            self.t.send(env)
            self._wait_one()
            times.append((time.perf_counter() - t0) / 2)
        self.result = times

    def _echo(self, iters, rows, hidden) -> None:
        for _ in range(iters):
            env = self._wait_one()
            self.t.send(Envelope(1, 0, env.model, env.kind, env.meta | {"replica": 1}, env.tensors))
        self.result = []

    def _run_actor(self, iters, rows, hidden) -> None:
        payload = encode_phase1(envelope(0, 1, rows, hidden, 0), 0, 0)
        times = []
        for _ in range(iters):
            self.event.clear()
            t0 = time.perf_counter()
            self.peer.bare.remote(payload)
            self.event.wait()
            times.append((time.perf_counter() - t0) / 2)
        self.result = times

    # -- bare gloo: hidden + residual bytes as ONE send/recv (the fewest ops that move them) --
    def _run_gloo(self, iters, rows, hidden) -> None:
        times = []
        out = torch.randn(2 * max(rows, 1), hidden)
        back = torch.empty_like(out)
        for i in range(iters):
            t0 = time.perf_counter()
            self.group.send([out], 1, i).wait()
            self.group.recv([back], 1, i).wait()
            times.append((time.perf_counter() - t0) / 2)
        self.result = times

    def _gloo_echo(self, iters, rows, hidden) -> None:
        buf = torch.empty(2 * max(rows, 1), hidden)
        for i in range(iters):
            self.group.recv([buf], 0, i).wait()
            self.group.send([buf], 0, i).wait()
        self.result = []

    def close(self) -> None:
        self.t.close()


class HopPair:
    """Two connected `HopActor`s on the Ray of this process (a context manager: closes them)."""

    def __init__(self, host: str, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 120) -> None:
        self.store, port = start_store(host)
        self.actors = [HopActor.remote(0, slot_bytes), HopActor.remote(1, slot_bytes)]
        peers = {0: self.actors[0], 1: self.actors[1]}
        ray.get([x.connect.remote(peers, host, port) for x in self.actors], timeout=timeout_s)

    def run(self, kind: str, echo: str | None, iters: int, rows: int, hidden: int) -> list[float]:
        """`iters` timed runs of `kind` on actor 0 (with `echo` answering on actor 1): seconds each."""
        a, b = self.actors
        if echo:
            ray.get(b.start.remote(echo, iters, rows, hidden))
        ray.get(a.start.remote(kind, iters, rows, hidden))
        while (res := ray.get(a.poll.remote())) is None:
            time.sleep(0.05)
        if echo:
            while ray.get(b.poll.remote()) is None:
                time.sleep(0.01)
        return res

    def __enter__(self) -> "HopPair":
        return self

    def __exit__(self, *exc) -> None:
        ray.get([x.close.remote() for x in self.actors], timeout=30)
        for x in self.actors:
            ray.kill(x)
        self.store = None


def measure_hop(cases: tuple[str, ...] = ("decode1", "prefill512"), iters: int = 60,
                warmup: int = 10) -> dict[str, tuple[float, int]]:
    """Median one-way hop through `RayTransport` per case: case -> (seconds, tensor bytes).
    Starts a local Ray instance for the run when this process has none (and stops it after)."""
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_worker_niceness", "0")  # as `paraflex serve` runs its engines
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address=LOCALHOST)
    try:
        with HopPair(LOCALHOST) as pair:
            out = {}
            for case in cases:
                rows, hidden = CASES[case]
                times = pair.run("transport", "echo", iters + warmup, rows, hidden)[warmup:]
                out[case] = (statistics.median(times), tensor_bytes(rows, hidden))
            return out
    finally:
        if started:
            ray.shutdown()
