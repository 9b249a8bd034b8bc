"""Whole engine steps of each model, timed on this machine: the calibration `paraflex profile`
adds to its op tables (the residual the cost model cannot see from ops alone).

Place in the data flow: `paraflex profile` (paraflex/commands/profile.py) calls `measure_steps`
with the config's models after writing the op tables; it builds one one-engine in-process
cluster per model holding the whole model as one stage (the served engine's own scheduler, KV
accounting, worker, sampler and in-process transport), runs it synchronously, and times:

- prefill: one prompt of P tokens and max_tokens 1 (one prefill step, with sampling), per P;
- decode: B prompts with max_tokens 1 + K minus the same with max_tokens 1, divided by K (one
  decode step of batch B, with sampling), per B;
- on a GPU also k prompts packed into one prefill, per k, and decode steps of B prompts at
  LONG_CONTEXT tokens, per B: what each prompt beyond the first and each token of context add
  (`PROBE_SIZES`).

Robust to other tenants of a shared machine (paraflex/costs/robust_timing.py), which only add
time and come in stretches: the runs are made in BLOCKS blocks of rounds, the models taking turns
block by block and the probes of a model round by round, and each probe's time is the median of
its per-block minima (a stretch that holds one block from start to end does not count). A size
whose time breaks physics (a prefill of more tokens or a decode of a bigger batch costing less,
or a point far off the Theil-Sen line of the others) gets another block, up to RETRIES times; a
break left after that is pooled into a non-decreasing series (pool adjacent violators), said in
the progress lines. `StepNoise` keeps each model's spread (how far the blocks' minima disagree),
what was re-measured and what was pooled, for profile.json's `noise`.

The residual (measured - the cost model's prediction from the tables just written) is fitted as a
line in P (prefill) and in B (decode) over those points (`fit_line`, Theil-Sen: one inflated
point does not tilt it); paraflex/costs/step_overheads.py stores and applies it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from paraflex.config.schema import Config
from paraflex.costs.costmodel import CostModel
from paraflex.costs.robust_timing import (MONOTONE_TOL, fit_line, line_outliers, make_monotone, monotone_breaks,
                                          robust_time, spread)
from paraflex.costs.step_overheads import StepOverhead
from paraflex.engine.core.sampling_params import SamplingParams

# probe sizes per device type: (prompt tokens, decode batches, prompts packed into one prefill of
# PACKED_PROMPT tokens each, decode batches at LONG_CONTEXT tokens of context each). A GPU runs
# large steps in the time a CPU runs small ones, so the residual is fitted over the sizes it serves;
# on a GPU the eager prefill's cost per packed prompt and the attention kernel's cost per token of
# context are measured too (the roofline's attention is far below the kernel's at these sizes)
PROBE_SIZES = {"cpu": ((16, 32, 64, 128), (1, 2, 4, 8), (), ()),
               "cuda": ((16, 128, 512, 1024), (1, 8, 32, 64), (2, 4, 8), (1, 8, 32))}
PACKED_PROMPT = 128
LONG_CONTEXT = 512
DECODE_STEPS = 8  # K
DECODE_PROMPT = 8  # tokens per decode-test prompt
MIN_REPEATS = 21  # runs per probe at least, over all blocks
BLOCKS = 3
RETRIES = 2
NO_CUT_MS = 1e9  # a target stage time no model reaches: the model stays one stage
# the probes' KV pool at most (the plan's when smaller): the probes hold a few hundred tokens,
# and the clusters of all models are up together (a GPU config's plan would give each the device)
PROBE_KV_BYTES = 2 << 30


def one_stage_config(config, name: str) -> Config:
    """`config` reduced to one engine serving `name` whole."""
    d = config.to_dict()
    d["cluster"] = {**d["cluster"], "num_engines": 1}
    d["models"] = [m for m in d["models"] if m["name"] == name]
    d["planner"] = {**d["planner"], "target_stage_time": NO_CUT_MS}
    d.pop("workload", None)
    return Config.from_dict(d, source=f"{config.source}, {name} alone")


@dataclass
class StepNoise:
    """How noisy one model's step timings were: the largest spread of a prefill / decode probe's
    block minima, and the sizes ("prefill@P", "decode@B") re-measured and pooled."""

    prefill_spread: float = 0.0
    decode_spread: float = 0.0
    remeasured: list[str] = field(default_factory=list)
    adjusted: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"prefill_spread": round(self.prefill_spread, 4), "decode_spread": round(self.decode_spread, 4),
                "remeasured": self.remeasured, "adjusted": self.adjusted}


class _ModelProbes:
    """One model's in-process cluster, its probes (prompts, max_tokens) and their blocks of runs."""

    def __init__(self, config, name: str) -> None:
        from paraflex.planner import plan
        from paraflex.serving.in_process import LLMCluster

        self.name = name
        alone = one_stage_config(config, name)
        placement = plan(alone)
        kv_bytes = min(PROBE_KV_BYTES, sum(placement.engines[0].kv_bytes.values()))
        self.cluster = LLMCluster(alone, placement, kv_bytes=kv_bytes)
        prefill, decode, packed, long = PROBE_SIZES["cuda" if self.cluster.device.type == "cuda" else "cpu"]
        fits = config.scheduler.max_batch_size
        self.prefill_sizes, self.packed_sizes = prefill, tuple(k for k in packed if k <= fits)
        self.decode_sizes, self.long_sizes = (tuple(b for b in decode if b <= fits),  # one step each
                                              tuple(b for b in long if b <= fits))
        batches = [[[7 + i] * DECODE_PROMPT for i in range(b)] for b in self.decode_sizes]
        long_batches = [[[7 + i] * LONG_CONTEXT for i in range(b)] for b in self.long_sizes]
        groups = {"prefill": [([[7] * p], 1) for p in self.prefill_sizes],
                  "packed": [([[7 + i] * PACKED_PROMPT for i in range(k)], 1) for k in self.packed_sizes],
                  "decode": [(q, 1) for q in batches], "decode+K": [(q, 1 + DECODE_STEPS) for q in batches],
                  "long": [(q, 1) for q in long_batches], "long+K": [(q, 1 + DECODE_STEPS) for q in long_batches]}
        self.probes, self.index = [], {}
        for group, probes in groups.items():
            self.index[group] = list(range(len(self.probes), len(self.probes) + len(probes)))
            self.probes += probes
        self.params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in self.probes]
        self.blocks: list[list[list[float]]] = [[] for _ in self.probes]  # probe -> blocks -> runs
        for (prompts, _), p in zip(self.probes, self.params):
            self.cluster.generate(name, prompts, p)  # warm-up

    def run_block(self, rounds: int, which: list[int]) -> None:
        """One block: `rounds` rounds, each running the probes `which` once in turn."""
        runs = {i: [] for i in which}
        for _ in range(rounds):
            for i in which:
                t0 = time.perf_counter()
                self.cluster.generate(self.name, self.probes[i][0], self.params[i])
                runs[i].append(time.perf_counter() - t0)
        for i, r in runs.items():
            self.blocks[i].append(r)

    def times(self, group: str) -> list[float]:
        return [robust_time(self.blocks[i]) for i in self.index[group]]

    def step_times(self, group: str) -> list[float]:
        """One decode step of each batch of `group` ("decode" or "long"): its K-step runs minus
        its one-token runs, over K."""
        return [(k - one) / DECODE_STEPS for one, k in zip(self.times(group), self.times(group + "+K"))]

    def prefill_times(self) -> list[float]:
        return self.times("prefill")

    def decode_times(self) -> list[float]:
        return self.step_times("decode")

    def suspect_probes(self) -> dict[str, list[int]]:
        """"prefill@P" / "decode@B" -> the probe indices to run again (a monotone break or an
        outlier from the line of the others)."""
        out = {}
        pre, dec = self.prefill_times(), self.decode_times()
        for i in set(monotone_breaks(pre)) | set(line_outliers(list(self.prefill_sizes), pre)):
            out[f"prefill@{self.prefill_sizes[i]}"] = [self.index["prefill"][i]]
        for k in set(monotone_breaks(dec)) | set(line_outliers(list(self.decode_sizes), dec)):
            out[f"decode@{self.decode_sizes[k]}"] = [self.index["decode"][k], self.index["decode+K"][k]]
        return out


def measure_steps(config, names: list[str], cost: CostModel, repeats: int = 5,
                  progress=None) -> tuple[list[StepOverhead], dict[str, StepNoise]]:
    """Time whole engine steps of each model of `names` and return their residuals over `cost`
    with the noise seen per model."""
    models = [_ModelProbes(config, name) for name in names]
    rounds = math.ceil(max(repeats, MIN_REPEATS) / BLOCKS)
    noise = {m.name: StepNoise() for m in models}
    try:
        for _ in range(BLOCKS):
            for m in models:  # the models take turns block by block: one busy stretch hits one block of each
                m.run_block(rounds, list(range(len(m.probes))))
        for _ in range(RETRIES):
            again = {m.name: m.suspect_probes() for m in models}
            if not any(again.values()):
                break
            for m in models:
                if again[m.name]:
                    if progress:
                        progress(f"{m.name}: re-measuring {', '.join(sorted(again[m.name]))} (breaks monotonicity "
                                 f"in size or lies off the line of the other sizes)")
                    noise[m.name].remeasured += sorted(again[m.name])
                    m.run_block(rounds, sorted({i for v in again[m.name].values() for i in v}))
        return [_residual(config, m, cost, noise[m.name], progress) for m in models], noise
    finally:
        for m in models:
            m.cluster.shutdown()


def _residual(config, m: _ModelProbes, cost: CostModel, noise: StepNoise, progress) -> StepOverhead:
    arch = config.model(m.name).arch
    L = arch.num_layers
    say = progress or (lambda line: None)
    prefill_probes = set(m.index["prefill"] + m.index["packed"])
    noise.prefill_spread = max(spread(m.blocks[i]) for i in prefill_probes)
    noise.decode_spread = max(spread(b) for i, b in enumerate(m.blocks) if i not in prefill_probes)
    series = {}
    for kind, sizes, measured in (("prefill", m.prefill_sizes, m.prefill_times()),
                                  ("decode", m.decode_sizes, m.decode_times())):
        fixed = make_monotone(measured)
        pooled = [f"{kind}@{s}" for s, a, b in zip(sizes, measured, fixed) if abs(a - b) > MONOTONE_TOL * a]
        if pooled:
            say(f"{m.name}: {', '.join(pooled)} still break monotonicity: pooled into a non-decreasing series")
        noise.adjusted += pooled
        series[kind] = fixed

    def decode_residual(b: int, context: int, measured: float, what: str) -> float:
        predicted = cost.decode_time(arch, L, b, b * context, first=True, last=True)
        say(f"{m.name}: decode step, batch {b}{what}: {1000 * measured:.2f} ms served vs {1000 * predicted:.2f} ms ops")
        return measured - predicted

    short, long = DECODE_PROMPT + 1 + DECODE_STEPS // 2, LONG_CONTEXT + 1 + DECODE_STEPS // 2
    decode = {b: decode_residual(b, short, t, "") for b, t in zip(m.decode_sizes, series["decode"])}
    # the residual's growth per token of context: long-context steps against short ones of the same batch
    per_context = [(decode_residual(b, long, t, f", context {long}") - decode[b]) / (b * (long - short))
                   for b, t in zip(m.long_sizes, m.step_times("long"))]
    d2 = max(0.0, statistics.median(per_context)) if per_context else 0.0
    d0, d1 = fit_line(m.decode_sizes, [decode[b] - d2 * b * short for b in m.decode_sizes])
    prefill = []
    for p, measured in zip(m.prefill_sizes, series["prefill"]):
        predicted = cost.prefill_time(arch, L, p, first=True, last=True)
        prefill.append(measured - predicted)
        say(f"{m.name}: prefill {p} tokens: {1000 * measured:.2f} ms served vs {1000 * predicted:.2f} ms ops")
    p0, p1 = fit_line(m.prefill_sizes, prefill)
    per_prompt = []  # what each prompt packed beyond the first adds over the line in tokens
    for k, measured in zip(m.packed_sizes, m.times("packed")):
        tokens = k * PACKED_PROMPT
        predicted = cost.prefill_time(arch, L, tokens, first=True, last=True, num_seqs=k)
        say(f"{m.name}: prefill of {k} packed prompts ({tokens} tokens): {1000 * measured:.2f} ms served vs "
            f"{1000 * predicted:.2f} ms ops")
        per_prompt.append((measured - predicted - p0 - p1 * tokens) / (k - 1))
    p2 = max(0.0, statistics.median(per_prompt)) if per_prompt else 0.0
    say(f"{m.name}: residual prefill {1000 * p0:.2f} ms + {1e6 * p1:.1f} us/token + {1e6 * p2:.1f} us/extra prompt, "
        f"decode {1000 * d0:.2f} ms + {1e6 * d1:.1f} us/request + {1e9 * d2:.1f} ns/token of context; blocks' "
        f"spread prefill {noise.prefill_spread:.0%}, decode {noise.decode_spread:.0%}")
    return StepOverhead.of(m.name, arch, p0, d0, p1, d1, p2, d2)
