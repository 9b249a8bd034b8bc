"""The requests one engine's scheduler knows: live ones by id, and the ids of those that ended.

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) opens a `StageRequest` here
when a prompt reaches a first stage (`add_request`) or a later stage first receives a request
(engine/core/later_stage_batches.py), and retires it when it finishes or is aborted. Ended ids
are remembered (the last `GONE_MEMORY` of them) so that late messages about them are dropped.
The table also hands out the engine's sequence numbers (requests and received batches alike),
which break ties between equal arrival times in every queue.
"""

from __future__ import annotations

from collections import OrderedDict

from paraflex.errors import ConfigError, ParaflexError

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.queues import ResidentStage
from paraflex.engine.core.request import StageRequest
from paraflex.engine.core.scheduled import ProtocolError

GONE_MEMORY = 100_000  # ids of finished/aborted requests remembered to drop late messages


class RequestTable:
    """Live requests by id (`live`), ended ids with their final state (`gone`), and the
    sequence number last handed out (`seq`)."""

    def __init__(self, track_history: bool = False):
        self.live: dict[str, StageRequest] = {}
        self.gone: OrderedDict[str, str] = OrderedDict()
        self.seq = 0
        self.track_history = track_history  # requests record every state they pass through (tests)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def check_new(self, req_id: str, prompt_len: int, max_new: int, prompt_token_ids: list[int] | None,
                  engine_id: int) -> None:
        """Refuse a new request whose id was used here or whose lengths make no sense."""
        if req_id in self.live or req_id in self.gone:
            raise ProtocolError(f"request id {req_id!r} already used on engine {engine_id}; request ids must be unique")
        if prompt_len < 1:
            raise ConfigError("prompt_len", f"request {req_id!r} has {prompt_len} prompt tokens; send at least one")
        if max_new < 1:
            raise ConfigError("max_tokens", f"request {req_id!r} asks for {max_new} new tokens; ask for at least one")
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_len:
            raise ProtocolError(f"request {req_id!r}: prompt_len {prompt_len} != len(prompt_token_ids) {len(prompt_token_ids)}")

    def open(self, req_id: str, st: ResidentStage, arrival: float, prompt_len: int, max_new: int,
             sampling: dict | None, token_ids: list[int] | None) -> StageRequest:
        """A new live request at stage `st`, with the next sequence number."""
        req = StageRequest(req_id, st.model, st.stage, arrival, self.next_seq(), prompt_len, max_new, sampling,
                           token_ids, self.track_history)
        self.live[req_id] = req
        return req

    def retire(self, req: StageRequest, final: str) -> None:
        """`req` ended in state `final`: no longer live, remembered as ended."""
        del self.live[req.req_id]
        self.remember(req.req_id, final)

    def remember(self, req_id: str, state: str) -> None:
        self.gone[req_id] = state
        if len(self.gone) > GONE_MEMORY:
            self.gone.popitem(last=False)

    def check(self, pool: BlockPool) -> None:
        """Raise ParaflexError unless every live request's KV is the pool's allocation for it
        (on host exactly when swapped, covering its context) and no ended request holds KV."""
        for rid, req in self.live.items():
            alloc = pool.get(rid)
            if alloc is not req.alloc:
                raise ParaflexError(f"{rid!r}: the request's allocation is not the pool's")
            if req.swapped != (alloc is not None and alloc.on_host):
                raise ParaflexError(f"{rid!r} in state {req.state} but its KV is {'on host' if alloc and alloc.on_host else 'not on host'}")
            if alloc is not None and alloc.token_capacity < req.context_len:
                raise ParaflexError(f"{rid!r} has {req.context_len} tokens of context but KV for {alloc.token_capacity}")
        for rid, state in self.gone.items():
            if rid in pool:
                raise ParaflexError(f"{rid!r} is {state} but still holds KV")
