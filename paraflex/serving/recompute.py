"""Preemption by recompute: a request stopped to free KV restarts from the tokens it has.

Place in the data flow: the serving frontend (paraflex/serving/frontend.py, under both backends)
keeps a `Restartable` record per live request and one `Restarts` book (engine request id ->
client request id, stops per model). When the KV-stall watch (paraflex/serving/kv_stall.py), or the in-
process runtime's exact stall check, names a request to stop, the frontend calls `Restarts.stop`
(`preempt`): the request's KV is freed on every stage under its current engine request id (as an
abort), and the request is held, keeping its place in dispatch. `to_release` says when its
replica can take it back: after another request of that replica ends (which frees KV), or at
once when none of its requests is running; one at a time, oldest first, so a restarted request
cannot take back the blocks the others just got and stall them again. The frontend then submits
what `Restarts.release` (`restart`) gives to the replica's first stage under a new engine
request id (the engines remember freed ids): the original prompt followed by every token the
client has received, `max_tokens` lowered by as many, and `SamplingParams.resumed` holding those
tokens (the last stage searches stop strings across the restart; a seeded generator skips the
draws already made). Until its new run has produced a token it holds no KV, so the watch is told
only the tokens of the current run (`run_tokens`) and never names it for nothing. The client's
stream pauses and goes on, as in vLLM's recompute preemption. A request preempted
`MAX_RECOMPUTES` times ends with the stall's error instead: a bound on the recompute work one
request can cost under sustained memory pressure. Pure logic: no torch, Ray or HTTP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_RECOMPUTES = 8


@dataclass(kw_only=True)
class Restartable:
    """What the frontend keeps of a live request to restart it (its `ClientRequest` extends this)."""

    model: str
    replica: int
    prompt: list[int]
    params: object  # SamplingParams (engine/worker/sampling.py), as the client gave it
    engine_rid: str  # the id the engines know it by now
    output: list[int] = field(default_factory=list)  # tokens the client has received
    recomputes: int = 0
    held: bool = False  # preempted, waiting for its replica to take it back
    resumed_at: int = 0  # len(output) at the last restart
    suffix: int = 0  # of the last engine id minted (they only grow: engines remember freed ids)

    @property
    def tokens(self) -> int:
        return len(self.output)

    @property
    def run_tokens(self) -> int:
        """Tokens of the current run: a restarted request holds KV only once it has one (the
        KV-stall watch's `tokens`)."""
        return len(self.output) - self.resumed_at


def preempt(rec: Restartable) -> bool:
    """Hold `rec` for a restart; False when it was preempted MAX_RECOMPUTES times already (the
    caller ends it instead). The caller frees it on every stage under its engine id first."""
    if rec.recomputes >= MAX_RECOMPUTES:
        return False
    rec.recomputes += 1
    rec.held = True
    return True


def held_by_model(records) -> dict[str, int]:
    """Per model: how many of `records` are held for a restart."""
    out: dict[str, int] = {}
    for rec in records:
        if rec.held:
            out[rec.model] = out.get(rec.model, 0) + 1
    return out


def to_release(live, key: tuple[str, int], ended: bool) -> str | None:
    """The held request of replica `key` = (model, replica) to restart now, or None.

    `live`: (request id, Restartable) pairs of every live request, oldest first; `ended`: a
    request of that replica has just ended (its KV is free)."""
    held = None
    running = False
    for rid, rec in live:
        if (rec.model, rec.replica) != key:
            continue
        if rec.held:
            held = held or rid
        else:
            running = True
    return held if ended or not running else None


def restart(rid: str, rec: Restartable, in_use) -> tuple[list[int], object]:
    """Make `rec` live again: a fresh engine id (not `in_use(id)`), and the (prompt, params) to
    submit under it."""
    n = rec.suffix + 1
    while in_use(engine_rid := f"{rid}#recompute{n}"):
        n += 1
    rec.engine_rid, rec.suffix = engine_rid, n
    rec.held = False
    rec.resumed_at = len(rec.output)
    params = dataclasses.replace(rec.params, max_tokens=rec.params.max_tokens - len(rec.output),
                                 resumed=list(rec.output))
    return rec.prompt + rec.output, params


class Restarts:
    """The frontend's books for restarts by recompute: which client request each engine request
    id serves (outputs of a stopped run map to nothing and are dropped), and the stops per
    model. The frontend calls it under its lock."""

    def __init__(self) -> None:
        self.client_of: dict[str, str] = {}  # engine request id -> client request id
        self.preemptions: dict[str, int] = {}  # model -> requests stopped and restarted

    def begin(self, rid: str) -> None:
        """A new request, known to the engines by its client id."""
        self.client_of[rid] = rid

    def in_use(self, rid: str, live) -> bool:
        """Whether `rid` names a live request (`live`: by client id) or an engine request."""
        return rid in live or rid in self.client_of

    def stop(self, rec: Restartable) -> bool:
        """Hold `rec` (`preempt`) and forget its engine id (the caller frees it on the engines
        under `rec.engine_rid`, still set); False when it was restarted too often already."""
        if not preempt(rec):
            return False
        del self.client_of[rec.engine_rid]
        self.preemptions[rec.model] = self.preemptions.get(rec.model, 0) + 1
        return True

    def end(self, rec: Restartable) -> None:
        """`rec` ended: forget its engine id (a held one has none)."""
        if not rec.held:
            del self.client_of[rec.engine_rid]

    def move(self, rid: str, rec: Restartable, live: dict) -> tuple[list[int], object]:
        """Run `rec` again from the tokens it has under a fresh engine id (`restart`), its
        current run forgotten (the caller frees it: its replica is leaving, live re-planning);
        not a preemption. Returns the (prompt, params) to submit."""
        del self.client_of[rec.engine_rid]
        prompt, params = restart(rid, rec, lambda x: self.in_use(x, live))
        self.client_of[rec.engine_rid] = rid
        return prompt, params

    def release(self, live: dict, key: tuple[str, int], ended: bool) -> tuple[str, list[int], object] | None:
        """The held request of replica `key` that `to_release` names, made live again under a
        fresh engine id (`restart`): (its client id, prompt, params) to submit, or None."""
        rid = to_release(live.items(), key, ended)
        if rid is None:
            return None
        rec = live[rid]
        prompt, params = restart(rid, rec, lambda x: self.in_use(x, live))
        self.client_of[rec.engine_rid] = rid
        return rid, prompt, params
