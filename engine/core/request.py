"""Per (request, stage) state, as kept by the engine that hosts that stage (paper §5, Fig. 7).

Place in the data flow: `EngineScheduler` (engine/core/scheduler.py) owns one `StageRequest` per
request it has seen for each resident stage; every state change goes through
`StageRequest.transition`, which raises `IllegalTransition` for a move the state diagram
does not allow. The KV blocks themselves live in engine/core/block_pool.py; this module only says
what a request is doing at one stage.

States (the paper's seven, plus `aborted` for cancelled requests):

    waiting-prefill   ready to run (a chunk of) its prompt at this stage
    waiting-decode    ready to run its next decode step here; KV resident
    running           inside the batch this engine is executing now
    swapped-decode    as waiting-decode, but its KV is in the host pool
    blocked           done at this stage, waiting for upstream (the next token or chunk)
    swapped-blocked   as blocked, but its KV is in the host pool
    finished          produced its last token; KV freed
    aborted           cancelled by the client; KV freed

Legal transitions (the arrows of Fig. 7)::

    (new)            -> waiting-prefill
    waiting-prefill  -> running                        scheduled (prefill or chunk)
    waiting-decode   -> running                        scheduled (decode)
    waiting-decode   -> swapped-decode                 evicted
    swapped-decode   -> waiting-decode                 swapped in (right before it runs)
    running          -> blocked                        stage done, wait for upstream
    running          -> waiting-prefill                a prompt chunk done, the next one ready
    blocked          -> waiting-decode                 the next token arrived
    blocked          -> waiting-prefill                the next prompt chunk arrived
    blocked          -> swapped-blocked                evicted
    swapped-blocked  -> swapped-decode                 the next token arrived while swapped
    swapped-blocked  -> blocked                        swapped in
    blocked, swapped-blocked -> finished               last token produced (free)
    any non-final    -> aborted                        cancelled (free)
"""

from __future__ import annotations

from paraflex.errors import ParaflexError

WAITING_PREFILL = "waiting-prefill"
WAITING_DECODE = "waiting-decode"
RUNNING = "running"
SWAPPED_DECODE = "swapped-decode"
BLOCKED = "blocked"
SWAPPED_BLOCKED = "swapped-blocked"
FINISHED = "finished"
ABORTED = "aborted"

STATES = (
    WAITING_PREFILL,
    WAITING_DECODE,
    RUNNING,
    SWAPPED_DECODE,
    BLOCKED,
    SWAPPED_BLOCKED,
    FINISHED,
    ABORTED,
)
TERMINAL = frozenset({FINISHED, ABORTED})
SWAPPED = frozenset({SWAPPED_DECODE, SWAPPED_BLOCKED})

LEGAL: dict[str, frozenset[str]] = {
    WAITING_PREFILL: frozenset({RUNNING, ABORTED}),
    WAITING_DECODE: frozenset({RUNNING, SWAPPED_DECODE, ABORTED}),
    SWAPPED_DECODE: frozenset({WAITING_DECODE, ABORTED}),
    RUNNING: frozenset({BLOCKED, WAITING_PREFILL, ABORTED}),
    BLOCKED: frozenset({WAITING_DECODE, WAITING_PREFILL, SWAPPED_BLOCKED, FINISHED, ABORTED}),
    SWAPPED_BLOCKED: frozenset({SWAPPED_DECODE, BLOCKED, FINISHED, ABORTED}),
    FINISHED: frozenset(),
    ABORTED: frozenset(),
}


class IllegalTransition(ParaflexError):
    """A state change that Fig. 7 does not allow: a bug in the driver or the scheduler."""


class StageRequest:
    """One request as seen by one resident stage of one engine.

    Token accounting: `prompt_len` prompt tokens; `prefilled` of them have run at this stage;
    `context_len` tokens have KV here (equal to `prefilled` until the first decode step, then
    one more per decode step); `generated` counts tokens sampled so far (kept on the first and
    the last stage). `token_ids` (first stage only, None in the simulator) is prompt plus
    generated tokens: the first stage embeds `token_ids[-1]` for a decode step.
    """

    __slots__ = (
        "req_id",
        "model",
        "stage",
        "arrival",
        "seq",
        "prompt_len",
        "max_new_tokens",
        "sampling",
        "token_ids",
        "state",
        "prefilled",
        "context_len",
        "generated",
        "batch_id",
        "pending_chunks",
        "abort_pending",
        "key",
        "history",
        "alloc",
    )

    def __init__(
        self,
        req_id: str,
        model: str,
        stage: int,
        arrival: float,
        seq: int,
        prompt_len: int,
        max_new_tokens: int,
        sampling: dict | None = None,
        token_ids: list[int] | None = None,
        track_history: bool = False,
    ):
        self.req_id = req_id
        self.model = model
        self.stage = stage
        self.arrival = arrival
        self.seq = seq
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.token_ids = token_ids
        self.state = WAITING_PREFILL
        self.prefilled = 0
        self.context_len = 0
        self.generated = 0
        self.batch_id: str | None = None
        self.pending_chunks = 0
        self.abort_pending = False
        # ascending arrival order; `seq` (the order this engine first saw it) breaks ties
        self.key = (arrival, seq)
        self.history: list[str] | None = [WAITING_PREFILL] if track_history else None
        self.alloc = None  # its BlockPool Allocation at this engine, once it has KV

    def transition(self, new: str) -> None:
        """Move to `new`, or raise `IllegalTransition` naming both states."""
        if new not in LEGAL[self.state]:
            legal = ", ".join(sorted(LEGAL[self.state])) or "none (terminal)"
            raise IllegalTransition(
                f"request {self.req_id!r} at {self.model} stage {self.stage}: illegal transition "
                f"{self.state} -> {new} (legal from {self.state}: {legal})"
            )
        self.state = new
        if self.history is not None:
            self.history.append(new)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def swapped(self) -> bool:
        return self.state in SWAPPED

    def __repr__(self) -> str:
        return (
            f"StageRequest({self.req_id!r}, {self.model}/{self.stage}, {self.state}, "
            f"ctx={self.context_len}, gen={self.generated})"
        )
