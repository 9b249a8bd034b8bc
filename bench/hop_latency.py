"""Per-hop latency of the two-phase Ray transport against the raw floor, measured in one run.

Where it sits: benchmarks the hop between engine actors (paraflex.engine.transport.ray), the
path every batch takes from one pipeline stage to the next. Two actors ping-pong envelopes;
one hop = half a round trip. Each direction is a stage-to-next-stage hop, as in serving: the
model has two replicas, (0, 1) and (1, 0), and the echo travels on the second. The floor is measured between the same two actors in the same
run: a bare Ray actor call carrying the same phase-1 bytes, plus a bare gloo send/recv of the
same tensor bytes as one buffer, the fewest gloo operations that move them (each also half a
round trip). The ratio hop / floor is printed per case; the target is <= 1.5x.

    python bench/hop_latency.py [--iters 200] [--cases decode1,decode32,prefill512] [--csv out.csv]
                                [--slot-bytes N]   (0: the rendezvous way, for A/B runs)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from paraflex.engine.transport.base import Envelope  # noqa: E402
from paraflex.engine.transport.ray import GroupSpec, RayTransport, start_store  # noqa: E402
from paraflex.engine.transport.ray_wire import encode_phase1  # noqa: E402
from paraflex.engine.transport.ray_slots import DEFAULT_SLOT_BYTES  # noqa: E402

# name -> (rows, hidden): SmolLM2-135M width (576), fp32 as served on CPU.
CASES = {
    "token": (0, 576),        # metadata only (last stage -> first stage): phase 1 alone
    "decode1": (1, 576),      # decode, batch 1
    "decode32": (32, 576),    # decode, batch 32
    "prefill512": (512, 576),  # prefill of 512 tokens
}
MODEL = "bench"
ROUNDS = 5


def _meta(rows: int) -> dict:
    """Phase-1 metadata shaped like an engine-core decode batch message."""
    n = max(rows, 1)
    return {"batch": 0, "stage": 1, "replica": 0, "request_ids": [f"req-{i:06d}" for i in range(n)],
            "positions": list(range(100, 100 + n)), "new_tokens": [7] * n}


def _envelope(src: int, dst: int, rows: int, hidden: int, batch_id: int) -> Envelope:
    meta = _meta(rows) | {"batch": batch_id}
    if rows == 0:
        return Envelope(src, dst, MODEL, "token", meta)
    t = torch.randn(rows, hidden)
    return Envelope(src, dst, MODEL, "batch", meta, {"hidden": t, "residual": t.clone()})


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
        self.echo_stop = threading.Event()

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
            env = _envelope(0, 1, rows, hidden, i)
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
        payload = encode_phase1(_envelope(0, 1, rows, hidden, 0), 0, 0)
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


def _run(actors, kind: str, echo: str | None, iters: int, rows: int, hidden: int) -> list[float]:
    a, b = actors
    if echo:
        ray.get(b.start.remote(echo, iters, rows, hidden))
    ray.get(a.start.remote(kind, iters, rows, hidden))
    while (res := ray.get(a.poll.remote())) is None:
        time.sleep(0.05)
    if echo:
        while ray.get(b.poll.remote()) is None:
            time.sleep(0.01)
    return res


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200, help="round trips per case (default 200)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")
    ap.add_argument("--csv", default=None, help="also write the table to this CSV file")
    ap.add_argument("--slot-bytes", type=int, default=DEFAULT_SLOT_BYTES,
                    help="the transport's pre-posted slot size (default %(default)s; "
                         "0 = every transfer the rendezvous way, for A/B runs)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            print(f"hop_latency: --cases: unknown case {c!r}; choose from {', '.join(CASES)}",
                  file=sys.stderr)
            return 2
    warmup = max(5, args.iters // 10)
    iters = args.iters + warmup

    ray.init(address=args.ray_address, num_cpus=None if args.ray_address else 2,
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    store, port = start_store("127.0.0.1" if not args.ray_address else ray.util.get_node_ip_address())
    host = "127.0.0.1" if not args.ray_address else ray.util.get_node_ip_address()
    actors = [HopActor.remote(0, args.slot_bytes), HopActor.remote(1, args.slot_bytes)]
    peers = {0: actors[0], 1: actors[1]}
    rows_out = []
    try:
        ray.get([x.connect.remote(peers, host, port) for x in actors], timeout=120)
        print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
              f"python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}, "
              f"gloo on loopback; {args.iters} round trips per case after {warmup} warm-up; "
              f"slot_bytes {args.slot_bytes}; load average {os.getloadavg()[0]:.1f}")
        print(f"{'case':<11} {'tensor bytes':>12} {'meta B':>7} {'hop med us':>10} {'hop p90':>8} "
              f"{'actor med':>9} {'gloo med':>8} {'floor med':>9} {'ratio':>6}")
        for case in cases:
            rows, hidden = CASES[case]
            meta_bytes = len(encode_phase1(_envelope(0, 1, rows, hidden, 0), 0, 0))
            tensor_bytes = 2 * rows * hidden * 4
            # Interleave the three measurements in rounds so machine noise hits them alike.
            hop_t, act_t, glo_t = [], [], []
            per = max(1, iters // ROUNDS)
            for _ in range(ROUNDS):
                hop_t += _run(actors, "transport", "echo", per, rows, hidden)[warmup // ROUNDS:]
                act_t += _run(actors, "actor", None, per, rows, hidden)[warmup // ROUNDS:]
                if rows:
                    glo_t += _run(actors, "gloo", "gloo_echo", per, rows, hidden)[warmup // ROUNDS:]
            hop, act = _stats(hop_t), _stats(act_t)
            glo = _stats(glo_t) if rows else (0.0, 0.0)
            floor = act[0] + glo[0]
            ratio = hop[0] / floor
            rows_out.append((case, tensor_bytes, meta_bytes, hop[0], hop[1], act[0], glo[0], floor, ratio))
            print(f"{case:<11} {tensor_bytes:>12} {meta_bytes:>7} {hop[0]*1e6:>10.0f} {hop[1]*1e6:>8.0f} "
                  f"{act[0]*1e6:>9.0f} {glo[0]*1e6:>8.0f} {floor*1e6:>9.0f} {ratio:>5.2f}x", flush=True)
        worst = max(r[-1] for r in rows_out)
        print(f"worst ratio hop/floor: {worst:.2f}x (target <= 1.5x): {'OK' if worst <= 1.5 else 'MISSED'}"
              f"; load average now {os.getloadavg()[0]:.1f}")
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("case,tensor_bytes,meta_bytes,hop_median_s,hop_p90_s,actor_median_s,"
                        "gloo_median_s,floor_median_s,ratio\n")
                for r in rows_out:
                    f.write(",".join(str(x) for x in r) + "\n")
    finally:
        ray.get([x.close.remote() for x in actors], timeout=30)
        for x in actors:
            ray.kill(x)
        del store
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
