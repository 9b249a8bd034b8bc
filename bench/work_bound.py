"""The most a cluster could achieve on a point's requests: a cost-model work bound (issue 26).

Place in the data flow: simulates one config at one rate and seed (Splitwise trace replay, as
`bench/reproduce_paper.py` does) for each named system, then prices the very requests of the
run with the cost model (paraflex/costs/costmodel.py) as if every engine were busy all the
time at the settings' best: each prompt prefilled through all its model's layers (one prompt
per batch, ParaFlex's §8.1 setting, or packed into batches of `--packed` tokens), every output
token decoded in a batch of `scheduler.max_batch_size` at its request's mean context, no hop,
no idle engine, no drain. Achieved req/s is finished requests over the span from the first
arrival to the last finish (the simulator's summary), so it cannot pass
requests / (engine-seconds / engines) however the work is placed or ordered.

Prints per system the achieved req/s, P99 E2E and span, then the bound per model and in all.

    python bench/work_bound.py [--config C] [--popularity 2.1] --rate 192 --seed 3
        [--duration 20] [--systems paraflex,alpaserve] [--packed 4096]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

from paraflex.config.schema import load_config
from paraflex.costs.costmodel import CostModel
from paraflex.simulator.runner import SimSettings, simulate
from reproduce_paper import with_popularity  # the sweep's own popularity rule (bench/ is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "data", "traces", "splitwise_conv.csv")


def request_seconds(cost: CostModel, arch, prompt_len: int, output_len: int, batch: int, packed: int | None = None) -> float:
    """Engine-seconds of one request at best: its prefill (alone, or its share of a `packed`-token
    batch) plus its output tokens after the first, each 1/`batch` of a full decode step."""
    layers = arch.num_layers
    if packed:
        prefill = prompt_len * cost.prefill_time(arch, layers, packed, True, True) / packed
    else:
        prefill = cost.prefill_time(arch, layers, prompt_len, True, True)
    context = prompt_len + output_len // 2  # attention is linear in context: the mean is exact
    step = cost.decode_time(arch, layers, batch, batch * context, True, True)
    return prefill + max(output_len - 1, 0) * step / batch


def work_by_model(records, arch_of, cost: CostModel, batch: int, packed: int | None = None) -> dict[str, float]:
    """Engine-seconds per model for `records` (the simulator's request records: model,
    prompt_len, output_len); `arch_of` maps a model name to its architecture."""
    work: dict[str, float] = collections.defaultdict(float)
    for r in records:
        work[r.model] += request_seconds(cost, arch_of[r.model], r.prompt_len, r.output_len, batch, packed)
    return dict(work)


def bound_rps(num_requests: int, engine_seconds: float, num_engines: int) -> float:
    """Requests over the shortest span the work allows on `num_engines` engines."""
    return num_requests * num_engines / engine_seconds


def point_config(path: str, popularity: str, duration: float, trace: str | None):
    """The config of one point: a `duration` s window with `popularity`, replaying `trace`
    (None: the config's own arrivals)."""
    config = load_config(path)
    config.workload = dataclasses.replace(config.workload, duration_s=duration, num_requests=None)
    if trace:
        config.workload = dataclasses.replace(config.workload, arrival="trace", trace=os.path.abspath(trace))
    return with_popularity(config, popularity)


def measure(config, systems: list[str], rate: float, seed: int, packed: int) -> tuple[dict, dict]:
    """Simulate each system on the same requests; returns (system -> summary, bound label ->
    (req/s, engine-seconds per model)) for one prompt per prefill batch and for `packed`."""
    cost = CostModel(config.cluster.device, tp=config.cluster.tp)
    arch_of = {m.name: m.arch for m in config.models}
    summaries, records = {}, []
    for system in systems:
        res = simulate(config, SimSettings(system=system, rate=rate, seed=seed))
        summaries[system] = res.summary
        records = list(res.metrics.requests.values())  # the same requests for every system
    bounds = {}
    for label, size in (("one prompt per prefill batch", None), (f"prompts packed to {packed} tokens", packed)):
        work = work_by_model(records, arch_of, cost, config.scheduler.max_batch_size, size)
        bounds[label] = (bound_rps(len(records), sum(work.values()), config.cluster.num_engines), work)
    return summaries, bounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(HERE, "..", "configs", "paper-base.yaml"))
    ap.add_argument("--popularity", default="2.1", help="balanced or a Zipf exponent")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--systems", default="paraflex,alpaserve")
    ap.add_argument("--packed", type=int, default=4096, help="tokens per packed prefill batch for the second bound")
    a = ap.parse_args(argv)
    config = point_config(a.config, a.popularity, a.duration, a.trace)
    summaries, bounds = measure(config, [x.strip() for x in a.systems.split(",")], a.rate, a.seed, a.packed)
    for system, s in summaries.items():
        print(f"{system}: {s['throughput_rps']:.1f} req/s, P99 E2E {s['e2e_p99_s']:.1f} s, span {s['simulated_s']:.1f} s")
    for label, (rps, work) in bounds.items():
        print(f"bound, {label}: {rps:.1f} req/s ({sum(work.values()):.0f} engine-s on {config.cluster.num_engines} "
              "engines; " + ", ".join(f"{m} {w:.0f} s" for m, w in work.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
