"""`full-batch-first` (paper §5, the default): full decode batches, then prefills, then
under-sized decode batches; ascending arrival order within each class, across all resident
stages of the engine.

Place in the data flow: chosen by `scheduler.policy` in the config; called by
`EngineScheduler.schedule`. A first stage's decode queue is "full" when it holds at least
`max_batch_size` ready requests; on a later stage a "full" batch is one the first stage formed
with `max_batch_size` requests.
"""

from __future__ import annotations

from paraflex.engine.core.policies.base import Policy

FULL_DECODE, PREFILL, SMALL_DECODE = 0, 1, 2


class FullBatchFirst(Policy):
    name = "full-batch-first"
    num_classes = 3
    classify_on_len = True

    def classify(self, sched, q):
        st = q.stage
        if q is st.prefill_q:
            return PREFILL
        if q is st.decode_q:
            return FULL_DECODE if st.is_first and len(q.items) >= sched.max_batch_size else SMALL_DECODE
        return FULL_DECODE  # a later stage's full-batch queue
