"""`sarathi` (Sarathi-Serve baseline): chunked prefill under a token budget.

A first stage forms one batch from its ready decodes (oldest first, up to `max_batch_size`) and
fills the rest of `prefill_token_budget` with prompt chunks of the oldest waiting prompts
("stall-free" mixed batches), while fewer than `num_stages` micro-batches of the model are in
flight (formed here and still awaiting their tokens). Later stages run received batches in
arrival order. Place in the data flow: chosen by `scheduler.policy: sarathi`; called by
`EngineScheduler.schedule`. The simulator replays its pure decode cycles in closed form (`replay`).
"""

from __future__ import annotations

from paraflex.engine.core.policies.base import ExactReplay, Policy


class Sarathi(Policy):
    name = "sarathi"
    num_classes = 1
    replay = ExactReplay(decode_cycles=True)

    def class_of(self, queue, first_stage, length, max_batch_size, num_stages=1):
        return 0

    def first_prefill(self, sched, st, now):
        if len(st.inflight) >= st.num_stages:
            return None
        return sched.first_stage.decode(st, sched.max_batch_size, now, prefill_budget=sched.prefill_token_budget)

    first_decode = first_prefill  # one mixed batch serves both queues
