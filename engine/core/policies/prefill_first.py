"""`prefill-first` (vLLM-like baseline): waiting prompts first, packed up to the token budget
and `max_batch_size` prompts per batch; then decode batches of any size, oldest first.

Place in the data flow: chosen by `scheduler.policy: prefill-first`; called by
`EngineScheduler.schedule`. The simulator replays its decode cycles in closed form (`replay`).
"""

from __future__ import annotations

from paraflex.engine.core.policies.base import ExactReplay, Policy


class PrefillFirst(Policy):
    name = "prefill-first"
    num_classes = 2
    replay = ExactReplay(decode_cycles=True)

    def default_prefill_max_requests(self, max_batch_size):
        return max_batch_size

    def class_of(self, queue, first_stage, length, max_batch_size, num_stages=1):
        return 0 if queue == "prefill" else 1
