"""`pipeline-first`: full-batch-first with a multi-stage model's decode batches ahead of
everything else on the engine (an experiment of issue 26 for model-size dispersion).

Place in the data flow: chosen by `scheduler.policy: pipeline-first`; called by
`EngineScheduler.schedule` like every policy. Classes: (0) every decode queue of a model with
more than one stage, at any stage and of any size (a first stage's returning groups, a later
stage's received batches), and every full decode batch; (1) prefills; (2) under-sized decode
batches of one-stage models. Within a class, oldest head first; the in-flight bound
(engine/core/policies/inflight_bound.py) still holds a first stage's under-sized batch back.

Why: in dispersion-4x each engine holds one stage of llama-80b and a one-stage llama-20b
replica; llama-80b's tokens waited ~19 ms at stage 0 and ~40 ms at stages 1-3 behind the
co-located llama-20b batches (docs/engine-core.md "Still open"). The simulator runs this policy
step by step (no exact fast-path replay).
"""

from __future__ import annotations

from paraflex.engine.core.policies.full_batch_first import FULL_DECODE, FullBatchFirst


class PipelineFirst(FullBatchFirst):
    name = "pipeline-first"
    replay = None

    def class_of(self, queue, first_stage, length, max_batch_size, num_stages=1):
        if num_stages > 1 and queue != "prefill":
            return FULL_DECODE  # a multi-stage model's decode batch, of any size: with the full ones
        return super().class_of(queue, first_stage, length, max_batch_size)
