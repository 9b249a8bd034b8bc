"""Does a served engine's prefill get faster the longer it runs? Prefills of random lengths timed
back to back in one fresh in-process engine, per time bin, beside what could explain a drift.

    python bench/prefill_drift.py [--seconds 90] [--out DIR]      # a CUDA machine (random-real shapes)
    python bench/prefill_drift.py --small --seconds 5             # the same path on a CPU

Why: on an H100 the served run of bench/sim_fidelity.py (2026-11-27, `--requests 400 --seed 2`)
logged prefill steps that shortened over the run whatever the load, e.g. llama-1b-shape's from
21.5 ms in its first minute to 14.7-15.2 ms after two and a half minutes, for prompt lengths seen
before as well as new ones; the calibration, early in the run, then predicts the later load
windows' prefills 6-17% long (docs/simulate.md, "Fidelity on a GPU").

One in-process engine holds the fidelity config's random-weight checkpoints (bench/
fidelity_setup.py), runs the start-up warm-up's rounds (paraflex/serving/warm_up.py), then sends one
request of max_tokens 1 (a prefill and its sampling) at a time, prompt lengths drawn uniformly from
`--lengths`, models in turn, for `--seconds`. Per bin of `--bin` seconds it prints the calls, the
median and 90th percentile of a call's wall time (normalised per model by its median over the
whole run, so models mix), the share of lengths the model had not met before, and the CUDA
caching allocator's device allocations (cudaMalloc calls), reserved segments and allocation
retries (`torch.cuda.memory_stats`), and full garbage collections: a drift that follows the
allocator's growth or first-met lengths is the engine's, one that follows neither is not.

Measured (NVIDIA H100 80GB HBM3, torch 2.11+cu130, Triton 3.6, 2026-11-27, `--seconds 110`):
8,461 prefills, median call llama-1b-shape 9.4 ms, qwen-0.5b-shape 10.0, smollm2-360m-shape 12.7
(the served prefill steps of the same lengths: 15-24 ms); per bin 1.06 of the median in the first
10 s (83% new lengths), 0.92-1.00 from 10 s to 80 s, 1.09-1.19 in the last 30 s; 154 device
allocations from the first bin on, no retry, no full collection. The engine alone does not speed up.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity_setup import REAL_SHAPES, SMALL_SHAPES, build_setup  # noqa: E402
from served_drift import python_workload_s  # noqa: E402
from ttft_split import cpu_flags  # noqa: E402

import torch  # noqa: E402

from paraflex.config.schema import Config  # noqa: E402
from paraflex.engine.core.sampling_params import SamplingParams  # noqa: E402
from paraflex.planner import plan  # noqa: E402
from paraflex.serving.in_process import LLMCluster  # noqa: E402
from paraflex.serving.warm_up import ROUNDS  # noqa: E402

CONTROL_ITERATIONS = 5000  # the control after each call: ~0.3 ms, short beside a prefill


def allocator() -> tuple[int, int, int]:
    """(device allocations so far, segments reserved now, allocation retries) of the CUDA
    caching allocator; zeros without CUDA."""
    if not torch.cuda.is_available():
        return 0, 0, 0
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("segment.all.current", 0), s.get("num_alloc_retries", 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="prefill-drift", help="where the random checkpoints go")
    ap.add_argument("--small", action="store_true", help="toy shapes (a dry run on a CPU)")
    ap.add_argument("--seconds", type=float, default=90.0, help="how long to send prefills (default 90)")
    ap.add_argument("--bin", type=float, default=10.0, help="seconds per printed bin (default 10)")
    ap.add_argument("--lengths", default="64-768", help="prompt lengths, uniform in LO-HI (default 64-768)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile-calls", type=int, default=0, metavar="N",
                    help="after the timed calls, N more under cProfile: the functions with the most own time")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    setup = build_setup("in-process", "random-small" if args.small else "random-real", os.path.abspath(args.out))
    table = SMALL_SHAPES if args.small else REAL_SHAPES
    config = Config.from_dict(setup.config, source="prefill-drift", base_dir=os.path.abspath(args.out))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"machine: {cpu_flags()}; {gpu}", flush=True)
    cluster = LLMCluster(config, plan(config))
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    models = [m.name for m in config.models]
    rng = random.Random(args.seed)
    try:
        for model in models:  # the start-up warm-up's rounds (it runs them through a serving backend)
            vocab = table[model][-1]
            for lengths in ROUNDS:
                cluster.generate(model, [[5 + i % (vocab - 5) for i in range(n)] for n in lengths], greedy)
        calls = []  # (seconds since start, model, wall s, first met, allocs, segments, retries, gen2)
        seen = {m: set() for m in models}
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < args.seconds:
            model = models[i % len(models)]
            i += 1
            vocab = table[model][-1]
            n = rng.randint(lo, min(hi, cluster.max_model_len(model) - 1))
            prompt = [5 + rng.randrange(vocab - 5) for _ in range(n)]
            t0, c0 = time.perf_counter(), time.thread_time()
            cluster.generate(model, [prompt], greedy)
            took, cpu = time.perf_counter() - t0, time.thread_time() - c0
            first = n not in seen[model]
            seen[model].add(n)
            calls.append((t0 - start, model, took, first, *allocator(), gc.get_stats()[2]["collections"], cpu,
                          python_workload_s(CONTROL_ITERATIONS)))
        if args.profile_calls:
            profile_calls(cluster, models, table, args.profile_calls, lo, hi, rng)
    finally:
        cluster.shutdown()
    report(calls, args.bin)
    return 0


def profile_calls(cluster, models: list[str], table: dict, n: int, lo: int, hi: int, rng) -> None:
    """`n` more prefills (models in turn) under cProfile: the 25 functions with the most own time."""
    import cProfile
    import pstats

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = [(models[i % len(models)], [5 + rng.randrange(table[models[i % len(models)]][-1] - 5)
                                          for _ in range(rng.randint(lo, hi))]) for i in range(n)]
    profiler = cProfile.Profile()
    profiler.enable()
    for model, prompt in prompts:
        cluster.generate(model, [prompt[:cluster.max_model_len(model) - 1]], greedy)
    profiler.disable()
    print(f"cProfile of {n} prefills (own time, the 25 largest):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def report(calls: list[tuple], bin_s: float) -> None:
    median = {m: statistics.median(c[2] for c in calls if c[1] == m) for m in {c[1] for c in calls}}
    print(f"{len(calls)} prefills; median per model: "
          + ", ".join(f"{m} {1000 * s:.1f} ms" for m, s in sorted(median.items())))
    print(f"the calls' own CPU time (this thread) over their wall time: "
          f"{sum(c[8] for c in calls) / sum(c[2] for c in calls):.2f}")
    control = statistics.median(c[9] for c in calls)
    print(f"control (a fixed pure-Python workload after each call): median {1e6 * control:.0f} us")
    print("bin (s)   calls  median  p90    cpu/wall  control  first-met  cudaMalloc  segments  retries  gen2 GCs   "
          "(times: call / model's median; control: its median / the run's)")
    bins: dict[int, list] = {}
    for c in calls:
        bins.setdefault(int(c[0] // bin_s), []).append(c)
    for b, rows in sorted(bins.items()):
        rel = sorted(c[2] / median[c[1]] for c in rows)
        p90 = rel[min(len(rel) - 1, int(0.9 * len(rel)))]
        last = rows[-1]
        cpu_share = sum(c[8] for c in rows) / sum(c[2] for c in rows)
        print(f"{b * bin_s:5.0f}-{(b + 1) * bin_s:<4.0f} {len(rows):5d}  {statistics.median(rel):.3f}  {p90:.3f}  "
              f"{cpu_share:8.2f}  {statistics.median(c[9] for c in rows) / control:7.3f}  "
              f"{sum(c[3] for c in rows) / len(rows):8.0%}  {last[4]:10d}  {last[5]:8d}  {last[6]:7d}  {last[7]:8d}")


if __name__ == "__main__":
    sys.exit(main())
