"""`full-batch-first` (paper §5, the default): full decode batches, then prefills, then
under-sized decode batches; ascending arrival order within each class, across all resident
stages of the engine.

Place in the data flow: chosen by `scheduler.policy` in the config; called by
`EngineScheduler.schedule`. On a later stage a "full" batch is one the first stage formed with
`max_batch_size` requests.
"""

from __future__ import annotations

from functools import partial

from paraflex.engine.policies.base import Policy, head_key, oldest_first


class FullBatchFirst(Policy):
    name = "full-batch-first"

    def pick(self, sched, now):
        full_size = sched.max_batch_size
        full, prefill, small = [], [], []
        for i, st in enumerate(sched.stages):
            dq, pq = st.decode_q, st.prefill_q
            if st.is_first:
                if dq.items:
                    attempt = partial(self.first_decode, sched, st, now)
                    (full if len(dq.items) >= full_size else small).append((head_key(dq), i, attempt))
                if pq.items:
                    prefill.append((head_key(pq), i, partial(self.first_prefill, sched, st, now)))
            else:
                if st.full_q.items:
                    full.append((head_key(st.full_q), i, partial(sched.try_pending, st, st.full_q, now)))
                if pq.items:
                    prefill.append((head_key(pq), i, partial(sched.try_pending, st, pq, now)))
                if dq.items:
                    small.append((head_key(dq), i, partial(sched.try_pending, st, dq, now)))
        return oldest_first(full) or oldest_first(prefill) or oldest_first(small)
