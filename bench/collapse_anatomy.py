"""Where an engine's time goes under the paper's rules and under ParaFlex's departures (issue 26).

Runs one config at one rate and seed (Splitwise trace replay by default) three times in the
same process, with the same requests:

  paper     the paper's rules: full-batch-first without a bound on a pipeline's decode batches
            in flight, Alg. 1 stopping when its pick is full, shares by stage count
            (--unbounded-decode-batches --paper-replication)
  bound     the decode in-flight bound only (scheduler.decode_batches_in_flight: stages)
  default   the bound and Alg. 1's fill onto spare engines (planner.fill_engines: true), with
            the config's replica shares

and prints, per run, the achieved throughput, E2E median/P99, each engine's busy share, each
model's decode batches (count, mean size), the request-seconds each stage's requests spent
blocked / waiting to decode / running, how long a multi-stage model's batches waited at each later
stage between arriving and starting (median, P99, total seconds, by batch kind), and each
model's mean time between tokens, a timeline (per `--bin` seconds: the engines' busy share,
each model's share of the engines' time, each model's unfinished requests), then the ratios
against `paper`. `--runs default` runs only the default rules. The step-by-step
simulation is used (no fast path) so that every batch passes through the recorder.

    python bench/collapse_anatomy.py CONFIG --rate 56 --seed 2 [--duration 30] [--balanced]
        [--zipf-alpha A] [--trace FILE] [--bin 10] [--runs paper,bound,default]

`--balanced` drops the config's Zipf popularity (every model at the same rate).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

from paraflex.config.schema import load_config
from paraflex.engine.core import request as request_mod
from paraflex.simulator.core import cluster as cluster_mod
from paraflex.simulator.runner import SimSettings, simulate

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "traces", "splitwise_conv.csv")
RUNS = {
    "paper": {"unbounded_decode_batches": True, "paper_replication": True},
    "bound": {"paper_replication": True},
    "default": {},
}


class Recorder:
    """Batches run (engine, model, kind, size, time), request time per (model, stage, state) and
    later-stage batch waits per (model, stage, kind), hooked into the simulator's
    `Cluster.start_batch`, `Cluster.deliver_batch` and `StageRequest.transition`."""

    def __init__(self):
        self.batches = []
        self.state_s = collections.defaultdict(float)
        self.waits = collections.defaultdict(list)
        self.clock = 0.0
        self._since = {}
        self._arrived = {}

    def install(self):
        rec = self
        start, transition, init = cluster_mod.Cluster.start_batch, request_mod.StageRequest.transition, request_mod.StageRequest.__init__
        deliver = cluster_mod.Cluster.deliver_batch

        def deliver_batch(cluster, eng, message, t):
            rec._arrived[(eng.id, message.batch_id)] = t
            return deliver(cluster, eng, message, t)

        def start_batch(cluster, eng, sb, t, end, decodes, tokens):
            rec.clock = t
            arrived = rec._arrived.pop((eng.id, sb.batch_id), None)
            if arrived is not None:  # a later stage: the batch waited here since it arrived
                rec.waits[(sb.model, sb.stage, sb.kind)].append(t - arrived)
            rec.batches.append((eng.id, sb.model, eng.stages[sb.model].stage, sb.kind, len(sb.requests), end - t, t))
            return start(cluster, eng, sb, t, end, decodes, tokens)

        def on_transition(req, new):
            key = id(req)
            rec.state_s[(req.model, req.stage, req.state)] += rec.clock - rec._since.get(key, rec.clock)
            rec._since[key] = rec.clock
            transition(req, new)
            if new in ("finished", "aborted"):
                rec._since.pop(key, None)

        def on_init(req, *args, **kw):
            init(req, *args, **kw)
            rec._since[id(req)] = rec.clock

        cluster_mod.Cluster.start_batch = start_batch
        cluster_mod.Cluster.deliver_batch = deliver_batch
        request_mod.StageRequest.transition = on_transition
        request_mod.StageRequest.__init__ = on_init
        return lambda: (setattr(cluster_mod.Cluster, "start_batch", start),
                        setattr(cluster_mod.Cluster, "deliver_batch", deliver),
                        setattr(request_mod.StageRequest, "transition", transition),
                        setattr(request_mod.StageRequest, "__init__", init))


def run_one(config, rate: float, seed: int, changes: dict):
    rec = Recorder()
    undo = rec.install()
    try:
        res = simulate(config, SimSettings(system="paraflex", rate=rate, seed=seed, fast_forward=False, **changes))
    finally:
        undo()
    return res, rec


def timeline(rec, res, span: float, bin_s: float) -> None:
    """Per `bin_s` seconds of simulated time: the engines' mean busy share, each model's share of
    the engines' time, and the requests of each model still unfinished at the bin's end."""
    nbins = int(span // bin_s) + 1
    busy = [collections.defaultdict(float) for _ in range(nbins)]
    for e, model, stage, kind, n, dt, t in rec.batches:
        busy[min(int(t // bin_s), nbins - 1)][model] += dt
    engines = res.placement.num_engines
    models = list(res.placement.models)
    finish = collections.defaultdict(list)
    for r in res.metrics.requests.values():
        finish[r.model].append(r.finish if r.finish >= 0 else float("inf"))
    print(f"   timeline per {bin_s:g} s: engines busy (mean) | share of engine time per model | unfinished requests per model")
    for b in range(nbins):
        end = (b + 1) * bin_s
        print(f"   {b * bin_s:5.0f}-{end:<5.0f} {100 * sum(busy[b].values()) / (engines * bin_s):4.0f}% | "
              + " ".join(f"{100 * busy[b][m] / (engines * bin_s):3.0f}" for m in models) + " | "
              + " ".join(f"{sum(f > end for f in finish[m]):4d}" for m in models))


def describe(name: str, res, rec, bin_s: float = 10.0) -> dict:
    s = res.summary
    span = s["simulated_s"]
    busy = collections.defaultdict(float)
    dec = collections.defaultdict(list)
    for e, model, stage, kind, n, dt, _ in rec.batches:
        busy[e] += dt
        if kind == "decode" and stage == 0:
            dec[model].append(n)
    pl = res.placement
    print(f"\n== {name}: {s['throughput_rps']:.2f} req/s achieved, E2E median {s['e2e_median_s']:.1f} s, "
          f"P99 {s['e2e_p99_s']:.1f} s, swaps out {s['swap_outs']}")
    print("   replicas: " + ", ".join(f"{m} {mp.num_replicas}x{mp.num_stages}" for m, mp in pl.models.items()))
    print("   engine busy share: " + " ".join(f"{100 * busy[e] / span:.0f}%" for e in range(pl.num_engines)))
    for model, sizes in dec.items():
        print(f"   {model:26s} decode batches {len(sizes):6d} (per stage), mean size {sum(sizes) / len(sizes):5.1f}")
    states = ("blocked", "waiting-decode", "running")
    print("   request-seconds per stage: " + "; ".join(
        f"{m} s{st}: " + "/".join(f"{rec.state_s[(m, st, x)]:.0f}" for x in states)
        for m, mp in pl.models.items() if mp.num_stages > 1 for st in range(mp.num_stages)) + " (blocked/waiting-decode/running)")
    for (m, st, kind), w in sorted(rec.waits.items()):
        w = sorted(w)
        print(f"   {m} stage {st} {kind:7s} batches wait on arrival: median {1e3 * w[len(w) // 2]:.1f} ms, "
              f"P99 {1e3 * w[int(0.99 * (len(w) - 1))]:.0f} ms, total {sum(w):.1f} s over {len(w)} batches")
    tbt = collections.defaultdict(list)
    for r in res.metrics.requests.values():
        if r.finish >= 0 and r.tokens > 1:
            tbt[r.model].append((r.last_token - r.first_token) / (r.tokens - 1))
    print("   mean TBT: " + ", ".join(f"{m} {1e3 * sum(v) / len(v):.0f} ms" for m, v in tbt.items()))
    timeline(rec, res, span, bin_s)
    return {"tput": s["throughput_rps"], "p99": s["e2e_p99_s"], "busy_max": max(busy.values()) / span}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--balanced", action="store_true", help="every model at the same rate (drop the config's Zipf)")
    ap.add_argument("--zipf-alpha", type=float)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--bin", type=float, default=10.0, help="seconds per row of the timeline")
    ap.add_argument("--runs", default=",".join(RUNS), help="which of the runs, comma-separated")
    a = ap.parse_args(argv)
    config = load_config(a.config)
    w = dataclasses.replace(config.workload, arrival="trace", trace=os.path.abspath(a.trace), duration_s=a.duration,
                            num_requests=None)
    if a.balanced:
        w = dataclasses.replace(w, zipf_alpha=None)
        for m in config.models:
            m.rate = 1.0
    elif a.zipf_alpha:
        w = dataclasses.replace(w, zipf_alpha=a.zipf_alpha)
        w.write_zipf_rates(config.models)
    config.workload = w
    pop = "balanced" if a.balanced else f"Zipf {w.zipf_alpha:g}" if w.zipf_alpha else "config rates"
    print(f"{config.name or a.config}: {pop}, {a.rate:g} req/s offered, seed {a.seed}, {a.duration:g} s window")
    out = {}
    for name in a.runs.split(","):
        t0 = time.perf_counter()
        res, rec = run_one(config, a.rate, a.seed, RUNS[name])
        out[name] = describe(name, res, rec, a.bin)
        print(f"   ({time.perf_counter() - t0:.0f} s wall)")
    if "paper" in out:
        base = out["paper"]["tput"]
        print("\nachieved throughput x paper: " + ", ".join(f"{k} {v['tput'] / base:.2f}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
