"""Simulator speed: simulated requests per wall-clock second for the §8.2 base case.

Runs the paper-base config (ParaFlex placement, full-batch-first; engines of 8 GPUs) with the
cluster scaled to 1, 2 and 8 engines (8, 16, 64 GPUs; the total rate scales with the engine
count, so load per engine stays the same; 4 GPUs cannot hold the base case's four models,
285 GB of weights against 4 x 80 GB x 90%, so the smallest case is one 8-GPU engine) at N
and 2N requests, at each load given (requests/s per engine: the base 0.5 and a busier one),
and prints requests per wall-second (whole run, and the event loop alone, without building
the engines), requests per CPU-second of the whole run (steadier than wall time on a shared
machine), events per request, and the wall-time growth from N to 2N (2.0x = linear cost).

The work itself is not linear in the request count: output lengths are log-normal and arrivals
bursty (CV 12.3), so a longer run can draw a different mix. The table therefore also gives the
output tokens per request, the share of them that belong to multi-stage (pipeline) replicas
(llama-2-70b's 3-stage pipeline in the base case, interleaved with one-stage replicas on its
engines: the joint replay, simulator/fastpath/joint_replay.py, replays them together), events per output
token, and CPU microseconds per event (the per-event cost; with the replays it also carries the
replayed decisions, which are not events). `--seed` draws another workload; `--without
MODEL[,MODEL]` drops those models' requests from it (the rest unchanged): `--without
llama-2-70b` measures the base case without its pipeline.

Peers, measured in the same run:
- per case: the same simulation with the decode fast-forward off (`fast_forward=False`: every
  decode step through the event loop and the scheduler; results are identical, the table
  says so per case);
- on the first case: a naive event loop that keeps a plain list (wake-ups included) and sorts
  it before every pop (the textbook O(n log n)-per-event loop a heap replaces).

    python bench/sim_speed.py [--requests 100] [--engines 1,2,8] [--rates 0.5,2] [--repeat 1] [--seed 0]
                              [--without MODEL,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from paraflex.config.schema import load_config
from paraflex.simulator.core.event_loop import EventLoop
from paraflex.simulator.runner import SimSettings, simulate
from paraflex.simulator.workload import workload_of
from paraflex.simulator.systems.layouts import build_system
from paraflex.simulator.workload import WorkloadModel, generate
from paraflex.cpu_info import machine_line

RUN_ONLY = ("wall_s", "setup_wall_s", "sim_requests_per_wall_s", "events", "fast_forward_cycles")


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


def _requests(cfg, rate, seed, without):
    """The workload `simulate` generates for `cfg`, minus the requests of the models `without`
    (None when there are none to drop: `simulate` generates it itself)."""
    if not without:
        return None
    wl = workload_of(cfg)
    models = [WorkloadModel(m.name, m.arch.max_context, s) for m, s in zip(cfg.models, wl.model_shares(cfg.models))]
    reqs, _ = generate(models, wl, rate, seed)
    return [r for r in reqs if r.model not in without]


def _run(cfg, rate, layout, fast_forward=True, loop=None, repeat=1, seed=0, without=()):
    """(event-loop wall s, whole-run wall s, whole-run CPU s, result): each the least of
    `repeat` identical runs (other jobs on a shared machine only ever add time)."""
    best = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        reqs = _requests(cfg, rate, seed, without)
        res = simulate(cfg, SimSettings(rate=rate, seed=seed, fast_forward=fast_forward), layout=layout, loop=loop,
                       requests=reqs)
        whole, cpu = time.perf_counter() - t0, time.process_time() - c0
        now = (whole - res.summary["setup_wall_s"], whole, cpu)
        best = now if best is None else tuple(map(min, best, now))
    return (*best, res)


def _work(res, layout) -> tuple[int, float]:
    """(output tokens, share of them served by multi-stage replicas) of one run."""
    piped = {name for name, mp in layout.placement.models.items() if mp.num_stages > 1}
    total = pipe = 0
    for r in res.metrics.requests.values():
        total += r.output_len
        if r.model in piped:
            pipe += r.output_len
    return total, pipe / total if total else 0.0


def _same(a, b) -> bool:
    strip = lambda s: {k: v for k, v in s.items() if k not in RUN_ONLY}  # noqa: E731
    return list(a.metrics.request_rows()) == list(b.metrics.request_rows()) and strip(a.summary) == strip(b.summary)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "paper-base.yaml"))
    ap.add_argument("--engines", default="1,2,8")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rates", default="0.5,2", help="requests/s per engine, comma-separated")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each simulation this many times and report the least times (steadier on a shared machine)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (another seed draws another request mix)")
    ap.add_argument("--without", default="", help="comma-separated models whose requests are dropped from the workload")
    args = ap.parse_args()
    without = {m for m in args.without.split(",") if m}
    names = [m.name for m in load_config(args.config).models]
    unknown = sorted(without - set(names))
    if unknown:
        ap.error(f"--without: no model {unknown[0]!r} in {args.config}; its models: {', '.join(names)}")
    print(f"machine: {machine_line()}; times: least of {args.repeat} run(s); seed {args.seed}"
          + (f"; without {', '.join(sorted(without))}" if without else ""))
    print(f"{'req/s/eng':>9} {'engines':>7} {'GPUs':>5} {'requests':>8} {'events':>7} {'ev/req':>6} {'tok/req':>7} {'pipe%':>5} {'ev/tok':>6} {'us/ev':>5} {'run s':>6} "
          f"{'req/run-s':>9} {'whole s':>7} {'req/whole-s':>11} {'req/cpu-s':>9} {'growth':>6} | {'step-by-step':>12} "
          f"{'ev/req':>6} {'req/whole-s':>11} {'req/cpu-s':>9} {'speed-up':>8} {'cpu':>6} {'same':>4}")
    sort_peer = None
    for rpe in [float(x) for x in args.rates.split(",")]:
        for e in [int(x) for x in args.engines.split(",")]:
            cfg, rate = _config(args.config, e, args.requests, rpe)
            layout = build_system(cfg, SimSettings(system="paraflex"))
            first = None
            for mult in (1, 2):
                cfg_n, _ = _config(args.config, e, mult * args.requests, rpe)
                w, whole, cpu, res = _run(cfg_n, rate, layout, repeat=args.repeat, seed=args.seed, without=without)
                pw, pwhole, pcpu, peer = _run(cfg_n, rate, layout, fast_forward=False, repeat=args.repeat, seed=args.seed,
                                          without=without)
                tokens, pipe = _work(res, layout)
                n, ev, pev = res.summary["requests"], res.summary["events"], peer.summary["events"]
                growth = f"{w / first:.2f}x" if first else ""
                first = first or w
                print(f"{rpe:>9g} {e:>7} {e * cfg.cluster.tp:>5} {n:>8} {ev:>7} {ev / n:>6.0f} {tokens / n:>7.0f} {100 * pipe:>5.1f} "
                      f"{ev / tokens:>6.3f} {1e6 * cpu / ev:>5.0f} {w:>6.2f} {n / w:>9.0f} "
                      f"{whole:>7.2f} {n / whole:>11.0f} {n / cpu:>9.0f} {growth:>6} | {pwhole:>11.2f}s {pev / n:>6.0f} "
                      f"{n / pwhole:>11.0f} {n / pcpu:>9.0f} {pwhole / whole:>7.2f}x {pcpu / cpu:>5.2f}x "
                      f"{'yes' if _same(res, peer) else 'NO':>4}")
                if sort_peer is None:
                    sw, _, _, _ = _run(cfg_n, rate, layout, fast_forward=False, loop=SortingEventLoop(), seed=args.seed,
                                      without=without)
                    sort_peer = (rpe, e, n, pw, sw)
    rpe, e, n, heap_w, sort_w = sort_peer
    print(f"\nloop peer ({e} engine(s), {rpe:g} req/s per engine, {n} requests, same run, fast-forward off): heap loop "
          f"{heap_w:.2f} s vs sort-every-pop loop {sort_w:.2f} s -> heap is {sort_w / heap_w:.2f}x faster")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
