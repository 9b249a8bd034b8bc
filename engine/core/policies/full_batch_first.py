"""`full-batch-first` (paper §5, the default): full decode batches, then prefills, then
under-sized decode batches; ascending arrival order within each class, across all resident
stages of the engine.

Place in the data flow: chosen by `scheduler.policy` in the config; called by
`EngineScheduler.schedule`. A first stage's decode queue is "full" when it holds at least
`max_batch_size` ready requests; on a later stage a "full" batch is one the first stage formed
with `max_batch_size` requests. The simulator replays it in closed form with the decode
fast-forward and the joint replay of a pipeline's engines (`replay`).

Departure from the paper (the default; `scheduler.decode_batches_in_flight: unbounded` is the
paper's rule): a first stage of a multi-stage model forms an under-sized decode batch only
while fewer than its bound of decode batches are in flight (engine/core/policies/inflight_bound.py);
otherwise its ready requests wait for the batches in flight to return and leave with them.
"""

from __future__ import annotations

from paraflex.engine.core.policies.base import ExactReplay, Policy
from paraflex.engine.core.policies.inflight_bound import holds_back

FULL_DECODE, PREFILL, SMALL_DECODE = 0, 1, 2


class FullBatchFirst(Policy):
    name = "full-batch-first"
    num_classes = 3
    classify_on_len = True
    replay = ExactReplay(decode_cycles=True, pipeline_group=True)

    def class_of(self, queue, first_stage, length, max_batch_size, num_stages=1):
        if queue == "prefill":
            return PREFILL
        if queue == "decode":
            return FULL_DECODE if first_stage and length >= max_batch_size else SMALL_DECODE
        return FULL_DECODE  # a later stage's full-batch queue

    def first_decode(self, sched, st, now):
        if len(st.decode_q.items) < sched.max_batch_size and holds_back(sched.decode_inflight_limit, st):
            return None  # under-sized while the pipeline is full: wait for the batches in flight
        return sched.first_stage.decode(st, sched.max_batch_size, now)
