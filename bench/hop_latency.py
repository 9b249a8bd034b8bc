"""Per-hop latency of the two-phase Ray transport against the raw floor, measured in one run.

Where it sits: benchmarks the hop between engine actors (paraflex.engine.transport.ray), the
path every batch takes from one pipeline stage to the next. Two actors ping-pong envelopes;
one hop = half a round trip. Each direction is a stage-to-next-stage hop, as in serving: the
model has two replicas, (0, 1) and (1, 0), and the echo travels on the second. The floor is measured between the same two actors in the same
run: a bare Ray actor call carrying the same phase-1 bytes, plus a bare gloo send/recv of the
same tensor bytes as one buffer, the fewest gloo operations that move them (each also half a
round trip). The ratio hop / floor is printed per case; the target is <= 1.5x.
The actors and the way a hop is timed are paraflex/engine/transport/hop_probe.py's, shared with
`paraflex profile` (which stores the hop in profile.json for the simulator).

    python bench/hop_latency.py [--iters 200] [--cases decode1,decode32,prefill512] [--csv out.csv]
                                [--slot-bytes N]   (0: the rendezvous way, for A/B runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from paraflex.engine.transport.hop_probe import CASES, HopPair, envelope, tensor_bytes  # noqa: E402
from paraflex.engine.transport.ray_slots import DEFAULT_SLOT_BYTES  # noqa: E402
from paraflex.engine.transport.ray_wire import encode_phase1  # noqa: E402
from paraflex.cpu_info import machine_line  # noqa: E402

ROUNDS = 5


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
    host = "127.0.0.1" if not args.ray_address else ray.util.get_node_ip_address()
    try:
        with HopPair(host, args.slot_bytes) as pair:
            rows_out = _table(pair, cases, args, iters, warmup)
    finally:
        ray.shutdown()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,tensor_bytes,meta_bytes,hop_median_s,hop_p90_s,actor_median_s,"
                    "gloo_median_s,floor_median_s,ratio\n")
            for r in rows_out:
                f.write(",".join(str(x) for x in r) + "\n")
    return 0


def _table(pair: HopPair, cases: list[str], args, iters: int, warmup: int) -> list[tuple]:
    """Measure and print each case: the hop, the bare actor call and the bare gloo send/recv."""
    print(f"machine: {machine_line()}, torch {torch.__version__}, ray {ray.__version__}, "
          f"gloo on loopback; {args.iters} round trips per case after {warmup} warm-up; "
          f"slot_bytes {args.slot_bytes}")
    print(f"{'case':<11} {'tensor bytes':>12} {'meta B':>7} {'hop med us':>10} {'hop p90':>8} "
          f"{'actor med':>9} {'gloo med':>8} {'floor med':>9} {'ratio':>6}")
    rows_out = []
    for case in cases:
        rows, hidden = CASES[case]
        meta_bytes = len(encode_phase1(envelope(0, 1, rows, hidden, 0), 0, 0))
        nbytes = tensor_bytes(rows, hidden)
        # Interleave the three measurements in rounds so machine noise hits them alike.
        hop_t, act_t, glo_t = [], [], []
        per = max(1, iters // ROUNDS)
        for _ in range(ROUNDS):
            hop_t += pair.run("transport", "echo", per, rows, hidden)[warmup // ROUNDS:]
            act_t += pair.run("actor", None, per, rows, hidden)[warmup // ROUNDS:]
            if rows:
                glo_t += pair.run("gloo", "gloo_echo", per, rows, hidden)[warmup // ROUNDS:]
        hop, act = _stats(hop_t), _stats(act_t)
        glo = _stats(glo_t) if rows else (0.0, 0.0)
        floor = act[0] + glo[0]
        ratio = hop[0] / floor
        rows_out.append((case, nbytes, meta_bytes, hop[0], hop[1], act[0], glo[0], floor, ratio))
        print(f"{case:<11} {nbytes:>12} {meta_bytes:>7} {hop[0]*1e6:>10.0f} {hop[1]*1e6:>8.0f} "
              f"{act[0]*1e6:>9.0f} {glo[0]*1e6:>8.0f} {floor*1e6:>9.0f} {ratio:>5.2f}x", flush=True)
    worst = max(r[-1] for r in rows_out)
    print(f"worst ratio hop/floor: {worst:.2f}x (target <= 1.5x): {'OK' if worst <= 1.5 else 'MISSED'}"
          f"; load average now {os.getloadavg()[0]:.1f}")
    return rows_out


if __name__ == "__main__":
    sys.exit(main())
