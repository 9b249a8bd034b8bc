"""The config's `scheduler:` section: batch size, KV block size, policy, prefill token budget,
the gateway's dispatch rule over a model's replicas, and per-model head starts in the queues.

Place in the data flow: `paraflex.config.schema` parses the section with `parse_scheduler` into
a `SchedulerConfig`; `engine_options` turns it into the keyword arguments of the engine's
scheduler (paraflex.engine.core), the same for a served engine and a simulated one, and the
KV block pools take `block_bytes`. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paraflex.config.fields import Section
from paraflex.engine.core.dispatcher import DISPATCH_RULES
from paraflex.errors import ConfigError

POLICIES = ("full-batch-first", "pipeline-first", "prefill-first", "sarathi")
# A CPU engine's prompt tokens per prefill batch when the config sets none (a GPU engine's is the
# scheduler's 4096). A CPU prefills ~1,000 tokens/s, so a 4,096-token step holds every packed
# prompt's first token (and every running decode) for ~4-5 s; in steps of 2,048 the first half
# of a burst gets its first token after half of that, at the same FLOP/s per row (vLLM's CPU
# server defaults to 2,048 too). SmolLM2-135M, 32 x 128-token prompts at once, 2 threads:
# median TTFT 4.91 -> 2.72 s, the burst's 128 tokens each done in 16.78 vs 17.16 s (3
# interleaved rounds; docs/engine-core.md, "Prefill token budget on a CPU").
CPU_PREFILL_TOKEN_BUDGET = 2048


@dataclass
class SchedulerConfig:
    max_batch_size: int = 32
    block_bytes: int = 32768
    policy: str = "full-batch-first"
    # None: the engine's default budget (4096 tokens; a CPU engine's CPU_PREFILL_TOKEN_BUDGET);
    # a number: pack prompts (and size Sarathi chunks) up to this many tokens per prefill batch.
    prefill_token_budget: int | None = None
    # pack waiting prompts (up to max_batch_size, under the budget) into one prefill batch; false
    # with no budget is the paper's one prompt per prefill batch (§8.1). docs/engine-core.md
    pack_prompts: bool = True
    # decode batches of a multi-stage model in flight at once: "stages" (S; the default), "Nx"
    # (N x S), a number, or "unbounded" (the paper's rule). engine/core/policies/inflight_bound.py
    decode_batches_in_flight: str | int = "stages"
    # over a model's replicas: least load (the default), the home replica first, or the paper's
    # least outstanding; engine/core/dispatcher.py
    dispatch: str = "least-load"
    home_margin: int = 4  # requests a home may hold beyond the least loaded replica
    # model name -> seconds its requests count as having arrived earlier when an engine orders
    # its queues (none: arrival order, the paper's); engine/core/scheduler.py, add_request
    head_start_s: dict[str, float] = field(default_factory=dict)

    def engine_options(self, on_cpu: bool) -> dict:
        """EngineScheduler keyword arguments (minus the policy's engine id), the same for a
        served engine (engine_builder) and a simulated one (simulator/core/cluster.py).

        Waiting prompts (up to `max_batch_size` of them) are packed into one prefill batch under
        the token budget (`prefill_token_budget`, else the scheduler's default): on a GPU a
        prompt's prefill costs less per token in a larger batch, and with one prompt per batch
        full-batch-first drained a skewed load's backlog late (issue 26, docs/engine-core.md,
        "Round 3"); a CPU matmul over all prompts' rows at once runs ~1.4x more FLOP/s than one
        prompt at a time (M=4096 vs M=128 rows for SmolLM2's shapes). `pack_prompts: false`
        without a budget keeps the paper's one prompt per prefill batch on a GPU (§8.1); a CPU
        engine packs whatever, its one forward pass per batch being the unit of work, under
        `CPU_PREFILL_TOKEN_BUDGET` tokens unless the config sets a budget."""
        opts: dict = {"max_batch_size": self.max_batch_size, "policy": self.policy,
                      "decode_batches_in_flight": self.decode_batches_in_flight, "head_start_s": dict(self.head_start_s)}
        budget = CPU_PREFILL_TOKEN_BUDGET if self.prefill_token_budget is None and on_cpu else self.prefill_token_budget
        if budget is not None:
            opts["prefill_token_budget"] = budget
        if self.pack_prompts or self.prefill_token_budget is not None or on_cpu:
            opts["prefill_max_requests"] = self.max_batch_size
        return opts


def parse_scheduler(raw) -> SchedulerConfig:
    s = Section(raw, "scheduler", tuple(SchedulerConfig.__dataclass_fields__))
    block = s.int("block_bytes", 32768, minimum=1)
    if block & (block - 1):
        raise ConfigError("scheduler.block_bytes", f"{block} is not a power of two (e.g. 32768)")
    return SchedulerConfig(
        max_batch_size=s.int("max_batch_size", 32, minimum=1),
        block_bytes=block,
        policy=s.str("policy", "full-batch-first", choices=POLICIES),
        prefill_token_budget=s.int("prefill_token_budget", None, minimum=1),
        pack_prompts=s.bool("pack_prompts", True),
        decode_batches_in_flight=_inflight(s),
        dispatch=s.str("dispatch", "least-load", choices=DISPATCH_RULES),
        home_margin=s.int("home_margin", 4, minimum=0),
        head_start_s=_head_starts(s),
    )


def _head_starts(s) -> dict[str, float]:
    """`scheduler.head_start_s`: a mapping of model names to finite seconds >= 0 (the names are
    checked against `models` once both are parsed, `check_head_starts`)."""
    raw = s.data.get("head_start_s") or {}
    if not isinstance(raw, dict):
        raise ConfigError(s.at("head_start_s"), "expected a mapping of model name to seconds, e.g. {llama-80b: 5}")
    out = {}
    for name, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ConfigError(f"{s.at('head_start_s')}.{name}", f"must be a finite number of seconds >= 0 (got {v!r})")
        out[str(name)] = float(v)
    return out


def check_head_starts(scheduler: SchedulerConfig, model_names) -> None:
    """Every model named in `scheduler.head_start_s` is served; ConfigError naming it otherwise."""
    names = set(model_names)
    for name in scheduler.head_start_s:
        if name not in names:
            raise ConfigError(f"scheduler.head_start_s.{name}", f"no model named {name!r}; served models: {', '.join(sorted(names))}")


def _inflight(s) -> str | int:
    from paraflex.engine.core.policies.inflight_bound import config_value, parse_inflight_limit

    raw = s.data.get("decode_batches_in_flight", "stages")
    return config_value(parse_inflight_limit(raw))
