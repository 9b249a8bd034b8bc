"""The joint replay's state of a pipeline's engines: what joint_capture.py captures at the start
and `GroupSim` (joint_sim.py) moves forward decision by decision.

Place in the data flow: per engine of the group a `GroupEngine` (its counters, queues, KV
headroom, the growth and busy intervals the replay records); the pipeline's decode batches
(`PipeBatch`), each one-stage replica's decode batch (`ReplicaBatch`), a one-stage prompt
running at the start (`Joiner`), a request the replay admitted (`Admitted`), a stage an earlier
replay accounted for (`HeldStage`); each request's KV on an engine is a `MemberKV` (kv_growth.py). The cut
(joint_cut.py) hands them back to the engines.
"""

from __future__ import annotations

from typing import NamedTuple

from paraflex.simulator.fastpath.kv_growth import MemberKV

END, ARRIVE, TOKENS = 10, 20, 30  # the group simulation's local events, in the event loop's order at one instant


class HeldStage(NamedTuple):
    """A stage an earlier replay accounted for, still running at the start (`ReplayEndEvent`)."""

    key: tuple[str, int]  # (model, replica)


class Finished(NamedTuple):
    """Members of a one-stage batch that produced their last token in its `steps`-th step."""

    rids: list[str]
    records: list
    steps: int


class LateJoin(NamedTuple):
    """A member that joined a one-stage batch after the replay's first step of it."""

    first_step: int  # the batch's step at which it joined (its first token time is that step's)
    formed_before: int  # batches the replay formed before it joined


class LastStep(NamedTuple):
    """A one-stage step with last tokens, running: formed at `start`, its KV growth from
    `grows_mark` in its engine's growth list (dropped if the cut forms it for real)."""

    start: float
    grows_mark: int


class PipeBatch:
    """A decode batch of the pipeline: its requests (batch order), their positions (context
    before the step), its id and formation time at the first stage."""

    __slots__ = ("rids", "pos", "n", "csum", "bid", "formed_at", "head")

    def __init__(self, rids, pos, bid: str, formed_at: float, head: float):
        self.rids = rids
        self.pos = pos
        self.n = len(rids)
        self.csum = sum(pos)
        self.bid = bid
        self.formed_at = formed_at
        self.head = head  # the earliest arrival among its requests (its key at later stages)


class ReplicaBatch:
    """A one-stage replica's decode batch on its engine; `order` is its queue's place in the
    policy's order, (class, head key)."""

    __slots__ = ("key", "rids", "recs", "order", "head", "since", "ready", "csum", "n", "fn", "left", "kv",
                 "formed", "times", "rems", "keys", "info", "fin", "done", "late")

    def __init__(self, key, reqs, cls: int, fn, recs, info):
        self.key = key
        self.rids = [r.req_id for r in reqs]
        self.recs = recs
        self.keys = [r.key for r in reqs]
        self.head = min(self.keys) if reqs else None
        self.order = (cls, self.head)
        self.since = 0
        self.ready = False
        self.n = len(reqs)
        self.csum = sum(r.context_len for r in reqs)
        self.fn = fn
        self.rems = [r.max_new_tokens - r.generated for r in reqs]  # each member's tokens to come at the start
        # (plus, for a member that joined late, the steps before it joined)
        self.left = min(self.rems) if reqs else 0  # steps to its first last token (a step with left == 1 finishes requests)
        self.kv = [MemberKV(r.alloc, r.context_len) for r in reqs]
        self.info = info  # its StageInfo (a new step time function when members leave)
        self.formed = 0  # batches formed by replayed decisions
        self.times: list[float] = []  # its token times (every step since the start)
        self.fin: LastStep | None = None  # its step with last tokens, running
        self.done: list[Finished] = []  # the members that finished, in order
        self.late: dict[str, LateJoin] | None = None  # members that joined after a step

    def resize(self, eng, cls: int) -> None:
        """After members finished or one joined: its size, step time function, head, and its
        policy class `cls` at its new size."""
        self.n = len(self.rids)
        self.fn = eng.decode_time_fn(self.info, self.n)
        self.head = min(self.keys)
        self.order = (cls, self.head)


class Joiner:
    """A one-stage replica's prompt running (its prefill formed for real) on a group engine
    when the replay starts: at its end the request has its first token and joins its replica's
    decode batch (`GroupSim.join`); the cut completes its prefill (`complete` and the token)."""

    __slots__ = ("key", "sb", "start", "end", "tokens", "rid", "req_key", "rem", "kv", "rec", "joined", "adm")

    def __init__(self, key, ev, req, rec):
        self.key = key  # (model, replica)
        self.sb = ev.batch  # the prefill batch (one request, the whole prompt)
        self.start, self.end, self.tokens = ev.start, ev.time, ev.tokens
        self.rid = req.req_id
        self.req_key = req.key
        self.rem = req.max_new_tokens - 1  # tokens to come after the first
        self.kv = MemberKV(req.alloc, req.prompt_len)
        self.rec = rec
        self.joined = False  # its end replayed: the request is in its replica's batch
        self.adm = None  # the `Admitted` request whose prompt it is, if the replay admitted it

    @classmethod
    def of_admitted(cls, adm: "Admitted", start: float, end: float) -> "Joiner":
        """The prompt of a request the replay admitted, formed at `start` (its batch and KV
        allocation are made at the cut: its growth names the request instead)."""
        jn = cls.__new__(cls)
        jn.key, jn.sb, jn.start, jn.end, jn.tokens = adm.key, None, start, end, adm.prompt_len
        jn.rid, jn.req_key, jn.rem, jn.rec, jn.joined = adm.rid, (adm.arrival, adm.seq), adm.max_new - 1, adm.rec, False
        jn.kv = MemberKV.planned(adm.rid, adm.blocks, adm.tpb, adm.layers, adm.prompt_len)
        jn.adm = adm
        return jn


class Admitted:
    """A one-stage request the replay admitted at its arrival (`GroupSim.admit`): waiting in its
    engine's prefill queue, then its prompt formed in the replay (`GroupDecisions.serve_prompt`;
    its end is a `Joiner`'s). The cut adds it to the scheduler as at its arrival and, if formed,
    forms its prompt batch there as at its formation. `order` is its prefill queue's place in
    the policy's order, (class, its key)."""

    __slots__ = ("key", "rid", "prompt_len", "max_new", "arrival", "rec", "info", "since", "seq", "order", "blocks",
                 "tpb", "layers", "formed", "d", "mark", "busy_mark", "batch_seq")

    def __init__(self, key, rid: str, prompt_len: int, max_new: int, arrival: float, rec, info, st, since: int, seq: int,
                 cls: int):
        self.key = key  # (model, replica)
        self.rid, self.prompt_len, self.max_new, self.arrival, self.rec, self.info = rid, prompt_len, max_new, arrival, rec, info
        self.since = since  # the decision count at its arrival (its prefill queue's age)
        self.seq = seq  # its sequence number: its key is (arrival, seq)
        self.order = (cls, (arrival, seq))
        self.tpb, self.layers = st.tokens_per_block, st.num_layers
        self.blocks = -(-prompt_len // self.tpb) * self.layers  # the KV its prompt takes
        self.formed = False
        self.d = self.mark = self.busy_mark = self.batch_seq = 0  # at its formation: decision count, index in
        # the engine's KV growth and busy intervals, batches formed on the engine before it


class GroupEngine:
    """One engine of the group during the replay."""

    __slots__ = ("eng", "j", "info", "d", "running", "blocks", "reserve", "replicas", "queue", "since", "pkv", "pgen",
                 "grows", "busy", "received", "formed", "promotions", "limit", "taken", "messages", "batch_seq", "seq",
                 "arrivals", "queued", "served_queued", "bid_of", "started", "nready", "fns", "joiner", "gone",
                 "admitted", "prompts")

    def __init__(self, eng, j: int, info, limit: int):
        self.eng = eng
        self.j = j  # the pipeline's stage here
        self.info = info
        s = eng.scheduler
        self.d = s.decisions
        self.batch_seq = s.first_stage.batch_seq
        self.seq = s.requests.seq
        self.running = None  # what runs: a ReplicaBatch, a PipeBatch, a Joiner or a HeldStage
        self.blocks = eng.pool.num_free
        self.reserve = s.kv.admission_reserve()  # free blocks a new prompt must leave
        self.replicas: list[ReplicaBatch] = []
        self.nready = 0  # replicas waiting in their decode queue
        self.queue: list = []  # the pipeline's queue here: waiting request ids (first stage) or PipeBatches
        self.since = 0  # its age
        self.pkv: dict[str, MemberKV] = {}  # the pipeline's requests' KV here
        self.pgen: dict = {}  # later stages: each pipeline request's tokens counted here (the last stage's count)
        self.bid_of: dict = {}  # first stage: the batch each of its requests is in
        self.grows: list = []  # KV growth (allocation, target tokens) and frees (None, request id), in order
        self.busy: list[tuple[float, float, int]] = []  # replayed steps: (start, end, batch size)
        self.received = 0
        self.formed = 0
        self.promotions = 0
        self.limit = limit  # the starvation limit (0: none)
        self.taken = None  # the StageEndEvent (or an earlier replay's ReplayEndEvent) it takes over
        self.messages: list = []  # the pipeline's message events to it, taken over
        self.arrivals: list[tuple] = []  # later stages: (batch, decisions before it, its receive index) of each received
        self.started = None  # the one-stage batch this engine formed at the start (no event yet)
        self.queued: set = set()  # later stages: ids of the batches queued at the start
        self.served_queued = 0  # later stages: how many of them ran
        self.fns: dict = {}  # the pipeline stage's decode time function per batch size
        self.joiner = None  # a one-stage prompt running here at the start (its end taken over)
        self.gone: list[str] = []  # the pipeline's requests that finished here (their KV freed)
        self.admitted = None  # a new request the replay admitted here, its prompt not formed yet (`Admitted`)
        self.prompts: list = []  # the prompts of the requests it admitted here, formed in the replay (`Joiner`s, in order)
