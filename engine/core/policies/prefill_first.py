"""`prefill-first` (vLLM-like baseline): waiting prompts first, packed up to the token budget
and `max_batch_size` prompts per batch; then decode batches of any size, oldest first.

Place in the data flow: chosen by `scheduler.policy: prefill-first`; called by
`EngineScheduler.schedule`.
"""

from __future__ import annotations

from paraflex.engine.core.policies.base import Policy


class PrefillFirst(Policy):
    name = "prefill-first"
    num_classes = 2

    def default_prefill_max_requests(self, max_batch_size):
        return max_batch_size

    def classify(self, sched, q):
        return 0 if q is q.stage.prefill_q else 1
