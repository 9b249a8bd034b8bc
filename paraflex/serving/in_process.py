"""In-process runtime: every engine of a placement as an object in this process.

Place in the data flow: `LLMCluster(config, placement=None)` plans (with `paraflex.planner`
when no placement is given), builds the engines (`InProcessEngines`,
paraflex/serving/in_process_engines.py: one `EngineLoop` per engine, wired with one
`LocalTransport`) and puts the serving frontend (paraflex/serving/frontend.py) over them: it
admits each request, dispatches it to a replica of its model (the config's dispatch rule), routes tokens back to the request's `OutputSink`, and restarts a request stopped to
free KV in a stall by recompute (paraflex/serving/recompute.py). What this class adds: a queue of
submits and aborts applied by the thread that steps the engines, the loop that steps them, and
the exact stall check (no engine can run anything and nothing travels between them). A request
reaches its first engine in the step that applies its submit; a restart (released on the way,
perhaps inside an engine's step) in the next one. Importable as `paraflex.serving.LLMCluster`
too.

Two ways to drive it:

* `generate(model, prompts, params)` -> list[`Result`]: blocking, for scripts, tests and
  `paraflex generate`;
* streaming, for the gateway: `submit(model, prompt_token_ids, params, request_id, sink)`,
  `abort(request_id)`, and either `step()` called by the owner or `start()` / `shutdown()`
  for a background thread that steps while there is work. `submit`/`abort` are thread-safe
  (they queue; the loop applies them); sink callbacks run on the loop thread. `call_on_loop(fn)`
  runs `fn` on that thread between steps (a stage joining or leaving an engine, live
  re-planning: paraflex/serving/in_process_stages.py) and returns its result.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.engine.engine_builder import choose_device
from paraflex.engine.transport.in_process import LocalTransport
from paraflex.engine.worker.tokenizer import Tokenizer, load_tokenizer
from paraflex.errors import ParaflexError, UserError
from paraflex.models.engine_support import require_runnable
from paraflex.planner.validate import require_valid_layout
from paraflex.serving.admission import kv_limits_by_model
from paraflex.serving.frontend import Frontend, end_quietly
from paraflex.serving.in_process_engines import InProcessEngines
from paraflex.serving.kv_stall import stall_message

log = logging.getLogger(__name__)


@dataclass
class Result:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict] | None = None


STALL_ROUNDS = 3  # rounds in which no engine ran anything and nothing travelled: a stall
WATCH_EVERY_S = 0.5  # how often the background loop asks the KV-stall watch about each replica


class _Collector:
    """Sink of `generate`: accumulates tokens into a `Result`."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.done = threading.Event()

    def on_output(self, request_id, token_ids, finish_reason, error, **extra):
        self.result.token_ids.extend(token_ids)
        if "logprobs" in extra:
            self.result.logprobs = (self.result.logprobs or []) + list(extra["logprobs"])
        if finish_reason is not None:
            self.result.finish_reason, self.result.error = finish_reason, error
            self.done.set()


class LLMCluster:
    def __init__(self, config, placement=None, *, device="auto", dtype="auto", kv_bytes=None,
                 host_kv_bytes=None, seed: int = 0, progress=None, solver: str = "paraflex",
                 models: list[str] | None = None) -> None:
        """kv_bytes / host_kv_bytes: per-engine KV pool and swap space (override the plan);
        progress: a callable taking one line of text, told about planning and loading;
        models: serve only these models of the placement (load nothing of the others)."""
        require_runnable(config, models)
        self.config = config
        if placement is None:
            from paraflex.planner import plan

            if progress:
                progress(f"planning {len(config.models)} model(s) on {config.cluster.num_engines} engine(s)")
            placement = plan(config, solver=solver)
        else:
            for problem in require_valid_layout(placement, config, required=models or []):  # serves what it places
                log.warning("placement: %s", problem)
        if models is not None:
            unknown = [m for m in models if m not in placement.models]
            if unknown:
                raise UserError(f"model: {unknown[0]!r} is not in the placement; models: {', '.join(placement.models)}")
            placement = _restrict(placement, models)
        self.placement = placement
        self.device = choose_device(device)
        self.dtype = dtype
        self.hub = LocalTransport()
        self._tokenizers: dict[str, Tokenizer] = {}
        self.engine_handles = InProcessEngines(
            config, placement, self.hub, self, self.tokenizer, device=self.device, dtype=dtype,
            kv_bytes=kv_bytes, host_kv_bytes=host_kv_bytes, seed=seed, progress=progress)
        self.engines = self.engine_handles.loops  # the EngineLoops of the engines holding a stage
        self.frontend = Frontend(config, placement, self.engine_handles,
                                 report=lambda line: log.info("runtime: %s", line),
                                 kv_limits=kv_limits_by_model(self.engine_handles.kv_token_limits()))
        self._inbox: list[tuple] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.loop_error: BaseException | None = None

    # ------------------------------------------------------------------ models
    def models(self) -> list[str]:
        return list(self.placement.models)

    def max_model_len(self, model: str) -> int:
        """The longest request (prompt + max_tokens) of `model` its engines can hold."""
        return self.frontend.max_model_len(model)

    def tokenizer(self, model: str) -> Tokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            mc = self.config.model(model)
            tok = self._tokenizers[model] = load_tokenizer(mc.source, mc.source_kind, model)
        return tok

    # ------------------------------------------------------------------ streaming API
    def submit(self, model: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, sink=None) -> str:
        """Queue a request; its output goes to `sink.on_output(...)`. Returns the request id."""
        prompt, params = self.frontend.admit(model, prompt_token_ids, params or SamplingParams())
        rid = request_id or f"req-{next(self._ids)}"
        with self._wake:
            if self.loop_error is not None:  # checked under the lock the failing loop takes
                raise ParaflexError(f"the engines stopped after an internal error ({self._loop_failure()}); "
                                    "restart the server")
            if self.frontend.in_use(rid) or any(e[1] == rid for e in self._inbox if e[0] == "add"):
                raise UserError(f"request_id: {rid!r} is already in use")
            self._inbox.append(("add", rid, model, prompt, params, sink))
            self._wake.notify()
        return rid

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request; its sink gets finish_reason "abort" (with `error`, if given).
        Unknown ids are ignored."""
        with self._wake:
            self._inbox.append(("abort", request_id, error))
            self._wake.notify()

    def call_on_loop(self, fn, timeout_s: float | None = None):
        """Run `fn()` on the thread that steps the engines, between steps, and return what it
        returns (or raise what it raises). Without a background thread: here, now."""
        with self._wake:
            if self._thread is None:
                return fn()
            if self.loop_error is not None:
                raise ParaflexError(f"the engines stopped after an internal error ({self._loop_failure()})")
            done: Future = Future()
            self._inbox.append(("call", fn, done))
            self._wake.notify()
        return done.result(timeout_s)

    def held(self) -> dict[str, int]:
        """Per model: requests stopped to free KV, waiting for their replica to restart them."""
        return self.frontend.held()

    def has_unfinished(self) -> bool:
        """Requests live or queued, or messages (tokens, frees) still travelling between engines;
        never after the loop failed (every request has ended, nothing will travel)."""
        with self._lock:
            return self.loop_error is None and self._has_work_locked()

    def _has_work_locked(self) -> bool:
        return bool(self._inbox) or self.frontend.has_live() or bool(self.engine_handles.pending())

    def step(self) -> bool:
        """Apply queued submits/aborts, then let every engine run at most one batch.
        True if anything happened."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        worked = self.engine_handles.deliver()  # restarts released since the last step
        for i, item in enumerate(inbox):
            try:
                self._apply(item)
            except BaseException:  # what was not applied goes back, for the failure path to end
                with self._lock:
                    applied = item[0] == "add" and self.frontend.is_live(item[1])
                    self._inbox[:0] = inbox[i + 1:] if applied else inbox[i:]
                raise
        worked |= bool(inbox)
        worked |= self.engine_handles.step()
        return worked

    def run_until_idle(self, timeout_s: float | None = None) -> None:
        """Drive `step()` in this thread until no request is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        idle = 0
        while self.has_unfinished():
            if self.step() or self.hub.pending():
                idle = 0
            else:
                idle += 1
                if idle > STALL_ROUNDS:
                    if not self._break_stall():
                        raise ParaflexError(self._stall_report())
                    idle = 0
            if deadline is not None and time.monotonic() > deadline:
                raise ParaflexError(f"generation did not finish within {timeout_s} s")

    def start(self) -> None:
        """Run the engines on a background thread (for servers)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="paraflex-runtime", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            with self._wake:
                self._stop = True
                self._wake.notify()
            self._thread.join()
            self._thread = None
        self.engine_handles.close()

    def _loop(self) -> None:
        idle = 0
        watched = time.monotonic()
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._has_work_locked():
                        self._wake.wait()
                    if self._stop:
                        return
                now = time.monotonic()
                if now - watched >= WATCH_EVERY_S:
                    watched = now
                    self.watch_stalls(now)
                if self.step() or self.hub.pending():
                    idle = 0
                    continue
                idle += 1
                if idle > STALL_ROUNDS and self._break_stall():
                    idle = 0
                else:
                    time.sleep(0.0005)
        except BaseException as exc:  # surface to the log and to every waiter instead of dying silently
            log.exception("runtime: the engine loop failed")
            with self._wake:
                self.loop_error = exc
                queued, self._inbox = self._inbox, []
            error = f"runtime loop failed: {self._loop_failure()}"
            self.frontend.fail_all(error)
            for item in queued:  # submitted, never applied: they end too
                if item[0] == "add":
                    end_quietly(item[1], item[5], error)
                elif item[0] == "call":
                    item[2].set_exception(ParaflexError(error))

    def _loop_failure(self) -> str:
        return f"{type(self.loop_error).__name__}: {self.loop_error}"

    # ------------------------------------------------------------------ blocking API
    def generate(self, model: str, prompts, params: SamplingParams | None = None,
                 timeout_s: float | None = None) -> list[Result]:
        """Generate for one prompt or a list (text, or token ids); returns one Result each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tok = self.tokenizer(model)
        collectors = []
        for p in prompts:
            ids = tok.encode(p) if isinstance(p, str) else list(p)
            res = Result("", model, ids)
            col = _Collector(res)
            res.request_id = self.submit(model, ids, params, sink=col)
            collectors.append(col)
        if self._thread is None:
            self.run_until_idle(timeout_s)
        for col in collectors:
            if not col.done.wait(timeout_s):
                raise ParaflexError(f"request {col.result.request_id} did not finish within {timeout_s} s")
        if self.loop_error is not None:
            raise ParaflexError(f"runtime loop failed: {self.loop_error}")
        for col in collectors:
            col.result.text = tok.decode(col.result.token_ids)
        return [c.result for c in collectors]

    # ------------------------------------------------------------------ the engines' side
    def on_output(self, request_id, token_ids, finish_reason, error, **extra) -> None:
        """The engines' sink: to the frontend, which maps the engine request id to the client's."""
        self.frontend.on_output(request_id, token_ids, finish_reason, error, **extra)

    def watch_stalls(self, now: float) -> None:
        """A replica stalled while others work (paraflex/serving/kv_stall.py): the frontend stops
        what the watch names. Called by the background loop about twice a second."""
        self.frontend.watch_stalls(now, self.engine_handles.run_counts())

    def _apply(self, item) -> None:
        if item[0] == "add":
            _, rid, model, prompt, params, sink = item
            try:
                self.frontend.start(rid, model, prompt, params, sink)
            except UserError as exc:  # its id was taken between submit and now (e.g. by a restart)
                end_quietly(rid, sink, str(exc))
                return
            self.engine_handles.deliver()  # it reaches its engine in this step
        elif item[0] == "call":
            _, fn, done = item
            try:
                done.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets it, the engines go on
                done.set_exception(exc)
        else:
            self.frontend.end(item[1], item[2])

    def _break_stall(self) -> bool:
        """No engine can run anything and nothing travels between them: the live requests' KV
        fills the pools and the swap space, and only an end frees some. Stop the newest request
        holding KV on an engine that has queued work (else anywhere), as vLLM preempts its
        newest: its KV frees on every stage, the others go on, and it restarts by recompute;
        requests still waiting for their prompt hold none and wait. False when no request holds
        KV."""
        running = self.frontend.running_engine_ids()
        rid = self.engine_handles.newest_holder(running)
        if rid is None:
            return False
        self.frontend.preempt(rid, stall_message(f"no engine could run any of the {len(running)} running requests "
                                                 f"({self.engine_handles.stuck_report()})"))
        return True

    def _stall_report(self) -> str:
        return (f"pipeline stalled with {len(self.frontend.live)} request(s) left: queued work that does not fit "
                f"in KV ({self.engine_handles.stuck_report()}); give later stages KV in proportion to their "
                "layers, add host swap space, or lower scheduler.max_batch_size")


def _restrict(placement, models):
    """The placement with only `models` (engines keep their ids; others become empty)."""
    from paraflex.placement import EnginePlacement, Placement

    engines = [
        EnginePlacement(e.id, [s for s in e.stages if s.model in models], e.weight_bytes,
                        {m: b for m, b in e.kv_bytes.items() if m in models})
        for e in placement.engines
    ]
    return Placement(placement.version, placement.planner, placement.params, placement.objective,
                     {m: p for m, p in placement.models.items() if m in models}, engines)
