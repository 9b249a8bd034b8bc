"""KV-stall watch: which live request to stop when a replica has stopped making progress.

Place in the data flow: the serving frontend (`Frontend.watch_stalls`, paraflex/serving/frontend.py)
calls `StallWatch.check` about twice a second, from the in-process runtime's background loop
(paraflex/serving/in_process.py) or the Ray backend's monitor thread (paraflex/serving/ray_monitor.py).
It passes what it knows: per engine, per resident model, how many batches started and finished
(`EngineLoop.runs`, None when the engine's numbers are not fresh this round); per replica, its
engines and its running requests (oldest first; not those held for a restart) with the tokens
each has received so far.

Why: the engine scheduler admits a prompt into free blocks only and never recomputes, so when
the live requests' decodes outgrow the KV pools and the swap space, a replica can wait for ever
(docs/engine-core.md's sizing requirement). A replica is stalled when it has live requests, none
of its engines is in the middle of a batch, and for `after_s` neither did any batch of its model
run on its engines nor did any of its requests receive a token. Then the newest of its requests
that has tokens (it holds KV on every stage of the replica) is named with an explicit error: the
frontend frees that KV and restarts the request by recompute (paraflex/serving/recompute.py), or ends it
with the error once it has been restarted too often; the others get `after_s` again; a replica
whose requests all wait for their prompt holds no KV and is left waiting. Other replicas working
meanwhile do not hide a stalled one. Pure logic: no torch, Ray or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraflex.serving.recompute import MAX_RECOMPUTES

STALL_AFTER_S = 5.0


@dataclass
class LiveRequest:
    rid: str
    tokens: int  # received so far


def live_by_replica(placement, live) -> dict[tuple[str, int], tuple[list[int], list[LiveRequest]]]:
    """`StallWatch.check`'s `replicas` from the frontend's live requests (`live`: client request
    id -> `recompute.Restartable`, oldest first): those held for a restart hold no KV and are
    left out; the others count the tokens of their current run (`run_tokens`)."""
    replicas: dict = {}
    for rid, rec in live.items():
        if rec.held:
            continue
        engines = placement.models[rec.model].replicas[rec.replica]
        replicas.setdefault((rec.model, rec.replica), (engines, []))[1].append(LiveRequest(rid, rec.run_tokens))
    return replicas


def stall_message(why: str) -> str:
    """The error a request stopped to free KV carries (both backends, both detections) when it
    ends instead of restarting (paraflex/serving/recompute.py)."""
    return (f"stopped to free KV memory: {why} (the live requests' KV fills the pools and the swap "
            f"space; it was restarted by recompute {MAX_RECOMPUTES} times already); retry it, or give the "
            "engines more KV memory (cluster.memory_gb) or swap space (cluster.host_memory_gb), or lower "
            "scheduler.max_batch_size")


class StallWatch:
    """Per replica: since when it made no progress; `check` returns the requests to stop."""

    def __init__(self, after_s: float = STALL_AFTER_S):
        self.after_s = after_s
        self._since: dict[tuple[str, int], float] = {}
        self._seen: dict[tuple[str, int], tuple] = {}  # replica -> (its batch counts, its tokens)

    def check(self, now: float, runs: dict[int, dict[str, tuple[int, int]] | None],
              replicas: dict[tuple[str, int], tuple[list[int], list[LiveRequest]]]) -> list[tuple[str, str]]:
        """runs[engine][model] = (batches started, batches finished); replicas[(model, j)] =
        (its engines, its live requests oldest first). Returns [(request id, error)] to end."""
        ends = []
        for key, (engines, live) in replicas.items():
            if not live:
                self._since.pop(key, None)
                self._seen.pop(key, None)
                continue
            if any(runs.get(e) is None for e in engines):
                continue  # a number is stale: decide on a later round
            model = key[0]
            counts = tuple(runs[e].get(model, (0, 0)) for e in engines)
            mid_batch = any(started != finished for e in engines for started, finished in runs[e].values())
            state = (counts, sum(r.tokens for r in live))  # arrivals change neither; a token or an end does
            moved = self._seen.get(key) != state
            self._seen[key] = state
            since = self._since.get(key)
            if moved or mid_batch or since is None:
                self._since[key] = now
                continue
            if now - since < self.after_s:
                continue
            self._since[key] = now
            holder = next((r for r in reversed(live) if r.tokens), None)
            if holder is not None:
                ends.append((holder.rid, stall_message(
                    f"no batch of {model} ran on its engines for {self.after_s:g} s while {len(live)} of its "
                    "requests were live")))
        return ends
