"""`prefill-first` (vLLM-like baseline): waiting prompts first, packed up to the token budget
and `max_batch_size` prompts per batch; then decode batches of any size, oldest first.

Place in the data flow: chosen by `scheduler.policy: prefill-first`; called by
`EngineScheduler.schedule`.
"""

from __future__ import annotations

from functools import partial

from paraflex.engine.policies.base import Policy, head_key, oldest_first


class PrefillFirst(Policy):
    name = "prefill-first"

    def default_prefill_max_requests(self, max_batch_size):
        return max_batch_size

    def pick(self, sched, now):
        prefill, decode = [], []
        for i, st in enumerate(sched.stages):
            dq, pq = st.decode_q, st.prefill_q
            if st.is_first:
                if pq.items:
                    prefill.append((head_key(pq), i, partial(self.first_prefill, sched, st, now)))
                if dq.items:
                    decode.append((head_key(dq), i, partial(self.first_decode, sched, st, now)))
            else:
                if pq.items:
                    prefill.append((head_key(pq), i, partial(sched.try_pending, st, pq, now)))
                for q in (st.full_q, dq):
                    if q.items:
                        decode.append((head_key(q), i, partial(sched.try_pending, st, q, now)))
        return oldest_first(prefill) or oldest_first(decode)
