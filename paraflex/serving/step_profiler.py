"""Whole engine steps of one model, timed on this machine: the calibration `paraflex profile`
adds to its op tables (the residual the cost model cannot see from ops alone).

Place in the data flow: `paraflex profile` (paraflex/commands/profile.py) calls `measure_steps`
per model after writing the op tables; it builds a one-engine in-process cluster holding the
whole model as one stage (the served engine's own scheduler, KV accounting, worker, sampler and
in-process transport), runs it synchronously, and times:

- prefill: one prompt of P tokens and max_tokens 1 (one prefill step, with sampling), per P;
- decode: B prompts with max_tokens 1 + K minus the same with max_tokens 1, divided by K (one
  decode step of batch B, with sampling), per B.

Each time is the fastest of at least MIN_REPEATS repeats, the points taking turns round after
round (a shared machine's other tenants only add time, and come in stretches; whole steps of
these models take milliseconds, so many tries to catch an undisturbed one cost little: a run
with 2 repeats at load average 12 measured a 16-token prefill of tiny-2l at 15 ms, one with 5
at load 6 at 1.5 ms, and 20 consecutive repeats per point during a busy stretch still 22 ms).

The residual (measured - the cost model's prediction from the tables just written) is fitted as a
line in P (prefill) and in B (decode) over those points (`fit_line`, Theil-Sen: one inflated
point does not tilt it); paraflex/costs/step_overheads.py stores and applies it.
"""

from __future__ import annotations

import time

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.robust_timing import fit_line
from paraflex.costs.step_overheads import StepOverhead
from paraflex.engine.core.sampling_params import SamplingParams

PREFILL_TOKENS = (16, 64, 128)
DECODE_BATCHES = (1, 4, 8)
DECODE_STEPS = 8  # K
DECODE_PROMPT = 8  # tokens per decode-test prompt
MIN_REPEATS = 20
NO_CUT_MS = 1e9  # a target stage time no model reaches: the model stays one stage


def one_stage_config(config, name: str) -> Config:
    """`config` reduced to one engine serving `name` whole."""
    d = config.to_dict()
    d["cluster"] = {**d["cluster"], "num_engines": 1}
    d["models"] = [m for m in d["models"] if m["name"] == name]
    d["planner"] = {**d["planner"], "target_stage_time": NO_CUT_MS}
    d.pop("workload", None)
    return Config.from_dict(d, source=f"{config.source}, {name} alone")


def _fastest(cluster, name: str, probes: list[tuple[list[list[int]], int]], repeats: int) -> list[float]:
    """The fastest of `repeats` runs of each probe (prompts, max_tokens), after a warm-up each.
    The probes take turns, round after round, so a stretch when other tenants hold the cores
    slows one run of every probe rather than all runs of one: each minimum is the engine's own
    cost (other tenants only ever add time)."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in probes]
    for (prompts, _), p in zip(probes, params):
        cluster.generate(name, prompts, p)  # warm-up
    best = [float("inf")] * len(probes)
    for _ in range(repeats):
        for i, ((prompts, _), p) in enumerate(zip(probes, params)):
            t0 = time.perf_counter()
            cluster.generate(name, prompts, p)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure_steps(config, name: str, cost: CostModel, repeats: int = 5, progress=None) -> StepOverhead:
    """Time whole engine steps of model `name` and return its residual over `cost`."""
    from paraflex.serving.in_process import LLMCluster

    arch = config.model(name).arch
    cluster = LLMCluster(one_stage_config(config, name))
    L = arch.num_layers
    batches = [[[7 + i] * DECODE_PROMPT for i in range(b)] for b in DECODE_BATCHES]
    probes = ([([[7] * p], 1) for p in PREFILL_TOKENS] + [(q, 1) for q in batches]
              + [(q, 1 + DECODE_STEPS) for q in batches])
    times = _fastest(cluster, name, probes, max(repeats, MIN_REPEATS))
    n_p, n_d = len(PREFILL_TOKENS), len(DECODE_BATCHES)
    prefill, decode = [], []
    for p, measured in zip(PREFILL_TOKENS, times[:n_p]):
        predicted = cost.prefill_time(arch, L, p, first=True, last=True)
        prefill.append(measured - predicted)
        if progress:
            progress(f"{name}: prefill {p} tokens: {1000 * measured:.2f} ms served vs {1000 * predicted:.2f} ms ops")
    for b, short, long in zip(DECODE_BATCHES, times[n_p:n_p + n_d], times[n_p + n_d:]):
        measured = (long - short) / DECODE_STEPS
        ctx = b * (DECODE_PROMPT + 1 + DECODE_STEPS // 2)
        predicted = cost.decode_time(arch, L, b, ctx, first=True, last=True)
        decode.append(measured - predicted)
        if progress:
            progress(f"{name}: decode step, batch {b}: {1000 * measured:.2f} ms served vs {1000 * predicted:.2f} ms ops")
    cluster.shutdown()
    p0, p1 = fit_line(PREFILL_TOKENS, prefill)
    d0, d1 = fit_line(DECODE_BATCHES, decode)
    if progress:
        progress(f"{name}: residual prefill {1000 * p0:.2f} ms + {1e6 * p1:.1f} us/token, "
                 f"decode {1000 * d0:.2f} ms + {1e6 * d1:.1f} us/request")
    return StepOverhead.of(name, arch, p0, d0, p1, d1)
