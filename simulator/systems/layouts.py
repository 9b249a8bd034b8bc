"""The serving systems the simulator compares (paper §8.1) and the ablations of §8.5.

A system is a layout (placement from `paraflex.planner.plan`, GPUs and memory per engine)
plus the local scheduling policy every engine runs; runner.py builds the simulated cluster
from it. Registered by name:

| name        | layout (planner solver)                                  | engine policy            |
|-------------|----------------------------------------------------------|--------------------------|
| paraflex    | time-balanced sharding, replication, DRF (`paraflex`)   | full-batch-first         |
| ray-serve   | each model alone on dedicated engines, PP=2 (`dedicated`)| prefill-first (vLLM)     |
| sarathi     | every model on every engine, same PP (`shared`)          | sarathi: chunked prefill,|
|             |                                                          | decode batches <= stages |
| alpaserve   | size groups, engines ∝ size x rate (`grouped`)           | prefill-first (vLLM)     |
| vllm-tp     | one TP group over all GPUs (`tensor`)                    | prefill-first (vLLM)     |

The seed systems `aegaeon`, `prism` and `muxserve` register from simulator/seeds/layouts.py: their
layouts carry a `seed` spec and run on their own simulated clusters.

Ablations (flags of `paraflex simulate`, applied to `paraflex` only except --prefill-first):
`no_sharding` (the `shared` layout with ParaFlex's scheduler), `random_placement` (ParaFlex's
sharding and replication, stages scattered uniformly at random, seeded; random_placement.py),
`prefill_first` (the prefill-first policy instead of the system's own), `pipeline_first` (ParaFlex
with the pipeline-first policy: a multi-stage model's decode batches ahead, an option tried for
model-size dispersion, docs/engine-core.md "Still open"). Departures from the
paper kept as ablations of `paraflex` (docs/engine-core.md, docs/plan.md):
`unbounded_decode_batches` (no in-flight bound on a pipeline's decode batches:
`scheduler.decode_batches_in_flight: unbounded`), `paper_replication` (Alg. 1 stops when the
chosen model is full: `planner.fill_engines: false`) and `one_prompt_prefills` (one prompt per
prefill batch, §8.1: `scheduler.pack_prompts: false`); and one option beyond the paper,
`work_shares` (Alg. 1's target shares by weight bytes: `planner.replica_shares: work`).
`memory_only_placement` is the paper's Alg. 2 without the compute balance the planner adds
after it (`planner.balance_compute: false`; docs/plan.md, "Compute balance").
`no_head_start` drops the config's `scheduler.head_start_s` (a ParaFlex option, so the baselines
never get one; docs/engine-core.md "Round 5").
"""

from __future__ import annotations

import dataclasses

from paraflex.simulator.seeds import layouts as seed_layouts  # noqa: F401  (registers aegaeon, prism, muxserve)
from paraflex.errors import UserError
from paraflex.placement import Placement
from paraflex.simulator.systems.system_layout import SYSTEMS, SystemLayout

__all__ = ["SYSTEMS", "SystemLayout", "build_system"]

SARATHI_CHUNK_TOKENS = 512


def _plan(config, solver: str) -> Placement:
    from paraflex.planner import plan

    return plan(config, solver=solver)


def _engine_shape(config, placement: Placement) -> tuple[int, int]:
    """GPUs and memory per engine: the cluster's, unless the planner merged engines into one
    TP group (the `tensor` layout records its `tp` and `engine_memory_bytes` in params)."""
    tp = int(placement.params.get("tp", config.cluster.tp))
    mem = int(placement.params.get("engine_memory_bytes", config.cluster.memory_bytes))
    return tp, mem


def _layout(name: str, config, solver: str, policy: str) -> SystemLayout:
    placement = _plan(config, solver)
    tp, mem = _engine_shape(config, placement)
    return SystemLayout(name, placement, policy, tp, mem)


@SYSTEMS.register("paraflex")
def paraflex(config, settings) -> SystemLayout:
    if settings.paper_replication:
        config = dataclasses.replace(config, planner=dataclasses.replace(config.planner, fill_engines=False))
    if settings.work_shares:
        config = dataclasses.replace(config, planner=dataclasses.replace(config.planner, replica_shares="work"))
    if settings.memory_only_placement:
        config = dataclasses.replace(config, planner=dataclasses.replace(config.planner, balance_compute=False))
    if settings.no_sharding:
        layout = _layout("paraflex", config, "shared", "full-batch-first")
    else:
        layout = _layout("paraflex", config, "paraflex", "full-batch-first")
    if settings.random_placement:
        from paraflex.simulator.systems.random_placement import random_placement

        archs = {m.name: m.arch for m in config.models}
        layout.placement = random_placement(layout.placement, archs, layout.memory_bytes, settings.seed)
    return layout


@SYSTEMS.register("ray-serve")
def ray_serve(config, settings) -> SystemLayout:
    return _layout("ray-serve", config, "dedicated", "prefill-first")


@SYSTEMS.register("sarathi")
def sarathi(config, settings) -> SystemLayout:
    # the engine core's `sarathi` policy chunks prefills and keeps at most `num_stages`
    # micro-batches of a model in flight; chunks of 512 tokens (Vidur's Sarathi default)
    layout = _layout("sarathi", config, "shared", "sarathi")
    layout.prefill_token_budget = SARATHI_CHUNK_TOKENS
    return layout


@SYSTEMS.register("alpaserve")
def alpaserve(config, settings) -> SystemLayout:
    return _layout("alpaserve", config, "grouped", "prefill-first")


@SYSTEMS.register("vllm-tp")
def vllm_tp(config, settings) -> SystemLayout:
    return _layout("vllm-tp", config, "tensor", "prefill-first")


def build_system(config, settings) -> SystemLayout:
    builder = SYSTEMS.get(settings.system, "--system")
    if (settings.no_sharding or settings.random_placement or settings.paper_replication or settings.work_shares
            or settings.memory_only_placement
            or settings.pipeline_first or settings.one_prompt_prefills or settings.no_head_start) and settings.system != "paraflex":
        raise UserError("--no-sharding, --random-placement, --paper-replication, --work-shares, --memory-only-placement, "
                        "--pipeline-first, "
                        "--one-prompt-prefills and --no-head-start are ablations of --system paraflex; drop them or use paraflex")
    if settings.prefill_first and settings.pipeline_first:
        raise UserError("--prefill-first and --pipeline-first each replace the policy; pass one of them")
    if settings.no_sharding and settings.random_placement:
        raise UserError("--no-sharding and --random-placement are separate ablations; pass one of them")
    layout = builder(config, settings)
    if settings.prefill_first:
        layout.policy = "prefill-first"
    if settings.pipeline_first:
        layout.policy = "pipeline-first"
    if settings.unbounded_decode_batches:
        layout.decode_batches_in_flight = "unbounded"
    if settings.one_prompt_prefills:
        layout.prefill_max_requests = 1
    if settings.no_head_start or settings.system != "paraflex":
        layout.head_start_s = {}  # a ParaFlex setting: the baselines keep arrival order
    return layout
