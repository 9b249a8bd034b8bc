"""The in-process engine handles: every engine of a placement as an `EngineLoop` in this process.

Place in the data flow: `LLMCluster` (paraflex/serving/in_process.py) builds one
`InProcessEngines` over a placement: one `EngineLoop` per engine holding a stage
(`build_engine`), all wired through one `LocalTransport`, their outputs to one sink. The
serving frontend (paraflex/serving/frontend.py) reaches them through `add_request` and `free`
(the `EngineHandles` interface, paraflex/serving/engine_handle.py); `LLMCluster.step` drives them
with `step()`. An engine is not thread-safe, and a request may be submitted from inside an
engine's step (a restart released by another request's end), so `add_request` only queues and
the driver calls `deliver()` outside the engines' steps; `step()` lets every engine run at most
one batch. `free` sends a free message through the transport (handled on the engine's next step) and drops a
queued submission of the same request that has not reached its engine. `newest_holder` and
`stuck_report` serve `LLMCluster`'s exact stall check. With `start_step_logs(DIR)` (`paraflex
serve --in-process --step-log DIR`) every batch an engine runs is logged to DIR/engine-<id>.csv
(engine/step_log.py), its `busy_s` the engine's step, flushed at most every FLUSH_EVERY_S.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from paraflex.engine.core.messages import FreeMessage
from paraflex.engine.engine_builder import build_engine, engine_routes
from paraflex.engine.transport.base import Envelope
from paraflex.engine.step_log import FLUSH_EVERY_S, StepLog, step_clock
from paraflex.errors import ParaflexError


@dataclass
class Submission:
    """A request queued for its first-stage engine (delivered on the next step)."""

    engine: int
    model: str
    engine_rid: str
    prompt: list[int]
    params: object


class InProcessEngines:
    """`EngineHandles` over the `EngineLoop`s of one placement (see the module docstring)."""

    def __init__(self, config, placement, hub, sink, tokenizer_of, *, device, dtype="auto", kv_bytes=None,
                 host_kv_bytes=None, seed: int = 0, progress=None) -> None:
        """hub: the `LocalTransport` the engines share; sink: their `OutputSink`;
        tokenizer_of(model): the tokenizer a last stage of `model` decodes with."""
        self.hub = hub
        self.sink = sink
        self.loops = []  # the EngineLoops of the engines holding at least one stage
        for eid in range(placement.num_engines):
            if not placement.engine(eid).stages:
                continue  # nothing resident (e.g. only other models' stages, filtered out)
            last_models = [m for m, (_, s, r) in engine_routes(placement, eid).items() if s == len(r) - 1]
            self.loops.append(build_engine(
                config, placement, eid, hub.endpoint(eid), sink, device=device, dtype=dtype,
                kv_bytes=kv_bytes, host_kv_bytes=host_kv_bytes, seed=seed,
                tokenizers={m: tokenizer_of(m) for m in last_models}, progress=progress,
            ))
        self._by_id = {e.engine_id: e for e in self.loops}
        self._queued: list[Submission] = []
        self._lock = threading.Lock()
        self.step_logs: dict[int, StepLog] = {}  # engine id -> its log, once `start_step_logs`
        self.flushed = 0.0  # time.monotonic() of the logs' last flush

    def loop_of(self, engine: int):
        """The `EngineLoop` of `engine`, or None when it holds no stage (none was built)."""
        return self._by_id.get(engine)

    def kv_token_limits(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per engine: its scheduler's `kv_token_limits()` (admission.kv_limits_by_model's input)."""
        return {e.engine_id: e.scheduler.kv_token_limits() for e in self.loops}

    # ------------------------------------------------------------------ EngineHandles
    def add_request(self, engine: int, model: str, engine_rid: str, prompt: list[int], params) -> None:
        with self._lock:
            self._queued.append(Submission(engine, model, engine_rid, prompt, params))

    def free(self, engine: int, model: str, engine_rids: list[str]) -> None:
        with self._lock:
            self._queued = [s for s in self._queued if not (s.engine == engine and s.engine_rid in engine_rids)]
        meta = FreeMessage(model, list(engine_rids), "aborted").to_dict()
        self.hub.send(Envelope(engine, engine, model, "free", meta))

    # ------------------------------------------------------------------ driving
    def deliver(self) -> bool:
        """Hand the queued submissions to their engines, oldest first (never call this inside an
        engine's step). True if there were any."""
        with self._lock:
            queued, self._queued = self._queued, []
        for sub in queued:
            try:
                self._by_id[sub.engine].add_request(sub.model, sub.engine_rid, sub.prompt, sub.params)
            except ParaflexError as exc:  # refused (e.g. an id used before): it ends, the engines go on
                self.sink.on_output(sub.engine_rid, [], "abort", f"engine {sub.engine} refused the request: {exc}")
        return bool(queued)

    def step(self) -> bool:
        """Let every engine run at most one batch. True if one ran."""
        worked = False
        logs = self.step_logs
        for engine in self.loops:
            clock = step_clock()
            ran = engine.step()
            if ran and engine.engine_id in logs:
                logs[engine.engine_id].record_last_run(engine, clock)
            worked |= ran
        if logs and time.monotonic() - self.flushed > FLUSH_EVERY_S:
            for log in logs.values():
                log.flush()
            self.flushed = time.monotonic()
        return worked

    def start_step_logs(self, directory: str) -> list[str]:
        """Log every batch each engine runs under `directory`; the files' paths. The loop thread
        starts writing on its next step."""
        logs = {e.engine_id: StepLog(directory, e.engine_id) for e in self.loops}
        for engine in self.loops:
            engine.last_run = None  # a batch run before the log started is not logged
        self.step_logs = logs
        return [log.path for log in logs.values()]

    def pending(self) -> int:
        """Submissions and messages (tokens, frees) not yet handled by their engine."""
        with self._lock:
            return len(self._queued) + self.hub.pending()

    def run_counts(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per engine: batches started and finished per model (the KV-stall watch's `runs`)."""
        return {e.engine_id: e.run_counts() for e in self.loops}

    def close(self) -> None:
        self.hub.close()
        for log in self.step_logs.values():
            log.close()

    # ------------------------------------------------------------------ the exact stall check
    def newest_holder(self, running: list[tuple[str, str]]) -> str | None:
        """The newest of `running` ((client id, engine id) pairs, oldest first) that holds KV on
        an engine with queued work, else on any engine; None when none holds KV."""
        stuck = [e for e in self.loops if e.has_work()]
        for engines in (stuck, self.loops):
            for rid, engine_rid in reversed(running):
                if any(_holds_kv(e, engine_rid) for e in engines):
                    return rid
        return None

    def stuck_report(self) -> str:
        """The KV of every engine with queued work, for a stall's error message."""
        return ", ".join(f"engine {e.engine_id}: {e.scheduler.pool.num_free} of {e.scheduler.pool.capacity} KV "
                         f"blocks free, {e.scheduler.pool.host_num_free} host blocks free"
                         for e in self.loops if e.has_work()) or "no engine has queued work"


def _holds_kv(engine, engine_rid: str) -> bool:
    req = engine.scheduler.request(engine_rid)
    return req is not None and req.alloc is not None
