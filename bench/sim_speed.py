"""Simulator speed: simulated requests per wall-clock second for the §8.2 base case.

Runs the paper-base config (ParaFlex placement, full-batch-first; engines of 8 GPUs) with the
cluster scaled to 1, 2 and 8 engines (8, 16, 64 GPUs; the total rate scales with the engine
count, so load per engine stays the same; 4 GPUs cannot hold the base case's four models,
285 GB of weights against 4 x 80 GB x 90%, so the smallest case is one 8-GPU engine) at N
and 2N requests, and prints requests per wall-second (whole run, and the event loop alone,
without building the engines) and the wall-time growth from N to 2N (2.0x = linear cost).
The peer, measured in the same run on the first case: the
same simulation driven by a naive event loop that keeps a plain list (wake-ups included) and
sorts it before every pop (the textbook O(n log n)-per-event loop a heap replaces).

    python bench/sim_speed.py [--requests 100] [--engines 1,2,8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

from paraflex.config import load_config
from paraflex.simulator.event_loop import EventLoop
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.systems import build_system


class SortingEventLoop(EventLoop):
    """Peer: the same interface, every event (wake-ups too) in a list sorted before every pop."""

    def schedule_last(self, event) -> None:
        self.schedule(event)

    def run(self, sim, until: float = float("inf")) -> None:
        q = self._heap
        cluster = sim.cluster
        while q:
            q.sort(key=lambda e: e[:3])
            if q[0][0] > until:
                return
            time_, _, _, event = q.pop(0)
            self.now = time_
            self.processed += 1
            event.handle(sim)
            if cluster.woken:
                cluster.settle(time_, bool(q) and min(e[0] for e in q) <= time_)


def _config(path: str, engines: int, n: int, rate_per_engine: float):
    cfg = load_config(path)
    cfg.cluster.num_engines = engines
    cfg.workload = dataclasses.replace(cfg.workload, duration_s=None, num_requests=n)
    return cfg, rate_per_engine * engines


def _time(cfg, rate, layout, loop=None):
    """(event-loop wall s, requests, events, whole-run wall s)."""
    t0 = time.perf_counter()
    res = simulate(cfg, SimSettings(rate=rate, seed=0), layout=layout, loop=loop)
    whole = time.perf_counter() - t0
    return whole - res.summary["setup_wall_s"], res.summary["requests"], res.summary["events"], whole


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "paper-base.yaml"))
    ap.add_argument("--engines", default="1,2,8")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rate-per-engine", type=float, default=0.5)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores (shared), python {platform.python_version()}")
    print(f"{'engines':>7} {'GPUs':>5} {'requests':>8} {'events':>9} {'run s':>7} {'req/run-s':>9} {'events/s':>9} "
          f"{'whole s':>8} {'req/whole-s':>11} {'growth N->2N':>12}")
    peer = None
    for e in [int(x) for x in args.engines.split(",")]:
        cfg, rate = _config(args.config, e, args.requests, args.rate_per_engine)
        layout = build_system(cfg, SimSettings(system="paraflex"))
        w1, n1, ev1, t1 = _time(cfg, rate, layout)
        cfg2, _ = _config(args.config, e, 2 * args.requests, args.rate_per_engine)
        w2, n2, ev2, t2 = _time(cfg2, rate, layout)
        for w, n, ev, t, g in ((w1, n1, ev1, t1, ""), (w2, n2, ev2, t2, f"{w2 / w1:.2f}x run")):
            print(f"{e:>7} {e * cfg.cluster.tp:>5} {n:>8} {ev:>9} {w:>7.2f} {n / w:>9.1f} {ev / w:>9.0f} "
                  f"{t:>8.2f} {n / t:>11.1f} {g:>12}")
        if peer is None:
            wp, _, _, _ = _time(cfg, rate, layout, loop=SortingEventLoop())
            peer = (e, w1, wp, n1)
    e, heap_w, sort_w, n = peer
    print(f"\npeer ({e} engines, {n} requests, same run): heap loop {heap_w:.2f} s vs sort-every-pop loop {sort_w:.2f} s "
          f"-> heap is {sort_w / heap_w:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
