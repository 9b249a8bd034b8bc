"""In-process runtime: every engine of a placement as an object in this process.

Place in the data flow: `LLMCluster(config, placement=None)` plans (with `paraflex.planner`
when no placement is given), builds one `EngineLoop` per engine (`build_engine`), wires them
with one `LocalTransport`, and dispatches each request to the replica of its model with the
fewest outstanding requests. Tokens flow back through an `OutputSink` per request. A request
stopped to free KV in a stall restarts by recompute (paraflex/serving/recompute.py) under a new engine
request id; the engines' outputs are mapped back to the client's id.

Two ways to drive it:

* `generate(model, prompts, params)` -> list[`Result`]: blocking, for scripts, tests and
  `paraflex generate`;
* streaming, for the gateway: `submit(model, prompt_token_ids, params, request_id, sink)`,
  `abort(request_id)`, and either `step()` called by the owner or `start()` / `shutdown()`
  for a background thread that steps while there is work. `submit`/`abort` are thread-safe
  (they queue; the loop applies them); sink callbacks run on the loop thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from paraflex.serving.admission import check_request, kv_limits_by_model, max_model_len
from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.engine.engine_builder import build_engine, choose_device, engine_routes
from paraflex.engine.core.messages import FreeMessage
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.engine.worker.tokenizer import Tokenizer, load_tokenizer
from paraflex.engine.transport.base import Envelope
from paraflex.engine.transport.in_process import LocalTransport
from paraflex.errors import ParaflexError, UserError
from paraflex.models.engine_support import require_runnable
from paraflex.serving.kv_stall import StallWatch, live_by_replica, stall_message
from paraflex.serving.recompute import Restartable, Restarts, held_by_model

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


@dataclass(kw_only=True)
class _Live(Restartable):
    sink: object


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
        if models is not None:
            unknown = [m for m in models if m not in placement.models]
            if unknown:
                raise UserError(f"model: {unknown[0]!r} is not in the placement; models: {', '.join(placement.models)}")
            placement = _restrict(placement, models)
        self.placement = placement
        self.device = choose_device(device)
        self.hub = LocalTransport()
        self._tokenizers: dict[str, Tokenizer] = {}
        self.engines = []  # the EngineLoops of the engines holding at least one stage
        for eid in range(placement.num_engines):
            if not placement.engine(eid).stages:
                continue  # nothing resident (e.g. only other models' stages, filtered out)
            last_models = [m for m, (_, s, r) in engine_routes(placement, eid).items() if s == len(r) - 1]
            toks = {m: self.tokenizer(m) for m in last_models}
            self.engines.append(build_engine(
                config, placement, eid, self.hub.endpoint(eid), self, device=self.device, dtype=dtype,
                kv_bytes=kv_bytes, host_kv_bytes=host_kv_bytes, seed=seed, tokenizers=toks,
                progress=progress,
            ))
        self._by_id = {e.engine_id: e for e in self.engines}
        self._kv_limits = kv_limits_by_model({e.engine_id: e.scheduler.kv_token_limits() for e in self.engines})
        self._live: dict[str, _Live] = {}  # by the client's request id, oldest first
        self.restarts = Restarts()  # engine request ids, stops per model (paraflex/serving/recompute.py)
        self.dispatcher = Dispatcher.from_placement(placement)
        self._inbox: list[tuple] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.loop_error: BaseException | None = None
        self.stall_watch = StallWatch()

    # ------------------------------------------------------------------ models
    def models(self) -> list[str]:
        return list(self.placement.models)

    def max_model_len(self, model: str) -> int:
        """The longest request (prompt + max_tokens) of `model` its engines can hold."""
        return max_model_len(self.config, self._kv_limits, model)

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
        params = (params or SamplingParams()).validate()
        prompt = check_request(self.config, self.placement, self._kv_limits, model, prompt_token_ids, params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        with self._wake:
            if self.loop_error is not None:  # checked under the lock the failing loop takes
                raise ParaflexError(f"the engines stopped after an internal error ({self._loop_failure()}); "
                                    "restart the server")
            if self.restarts.in_use(rid, self._live) or any(e[1] == rid for e in self._inbox if e[0] == "add"):
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

    def held(self) -> dict[str, int]:
        """Per model: requests stopped to free KV, waiting for their replica to restart them."""
        with self._lock:
            return held_by_model(self._live.values())

    def has_unfinished(self) -> bool:
        """Requests live or queued, or messages (tokens, frees) still travelling between engines;
        never after the loop failed (every request has ended, nothing will travel)."""
        with self._lock:
            return self.loop_error is None and self._has_work_locked()

    def _has_work_locked(self) -> bool:
        return bool(self._live or self._inbox or self.hub.pending())

    def step(self) -> bool:
        """Apply queued submits/aborts, then let every engine run at most one batch.
        True if anything happened."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for i, item in enumerate(inbox):
            try:
                self._apply(item)
            except BaseException:  # what was not applied goes back, for the failure path to end
                with self._lock:
                    applied = item[0] == "add" and item[1] in self._live
                    self._inbox[:0] = inbox[i + 1:] if applied else inbox[i:]
                raise
        worked = bool(inbox)
        for engine in self.engines:
            worked |= engine.step()
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
        self.hub.close()

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
                    self._watch_stalls(now)
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
            for rid in list(self._live):
                _guarded(rid, self._emit, rid, [], "abort", error)
            for item in queued:  # submitted, never applied: they end too
                if item[0] == "add" and item[5] is not None:
                    _guarded(item[1], item[5].on_output, item[1], [], "abort", error)

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

    # ------------------------------------------------------------------ internals
    def _holds_kv(self, rid: str, engines) -> bool:
        for engine in engines:
            req = engine.scheduler.request(rid)
            if req is not None and req.alloc is not None:
                return True
        return False

    def _stuck(self) -> str:
        return ", ".join(f"engine {e.engine_id}: {e.scheduler.pool.num_free} of {e.scheduler.pool.capacity} KV "
                         f"blocks free, {e.scheduler.pool.host_num_free} host blocks free"
                         for e in self.engines if e.has_work()) or "no engine has queued work"

    def _stall_report(self) -> str:
        return (f"pipeline stalled with {len(self._live)} request(s) left: queued work that does not fit "
                f"in KV ({self._stuck()}); give later stages KV in proportion to their layers, add host "
                "swap space, or lower scheduler.max_batch_size")

    def _apply(self, item) -> None:
        if item[0] == "add":
            _, rid, model, prompt, params, sink = item
            replica = self.dispatcher.pick(model)
            with self._lock:
                self._live[rid] = _Live(model=model, replica=replica, prompt=prompt, params=params,
                                        engine_rid=rid, sink=sink)
                self.restarts.begin(rid)
            self._submit_to_engine(model, replica, rid, prompt, params)
        elif item[0] == "restart":
            _, rid, engine_rid, prompt, params = item
            live = self._live.get(rid)
            if live is not None and live.engine_rid == engine_rid and not live.held:  # not ended or stopped meanwhile
                self._submit_to_engine(live.model, live.replica, engine_rid, prompt, params)
        else:
            self._end(item[1], item[2])

    def _submit_to_engine(self, model: str, replica: int, engine_rid: str, prompt, params) -> None:
        first = self.placement.models[model].replicas[replica][0]
        try:
            self._by_id[first].add_request(model, engine_rid, prompt, params)
        except ParaflexError as exc:  # refused (e.g. an id used before): it ends, the engines go on
            self.on_output(engine_rid, [], "abort", f"engine {first} refused the request: {exc}")

    def _free_everywhere(self, live: _Live) -> None:
        """Free the request's KV on every stage of its replica (as an abort)."""
        meta = FreeMessage(live.model, [live.engine_rid], "aborted").to_dict()
        for eid in self.placement.models[live.model].replicas[live.replica]:
            self.hub.send(Envelope(eid, eid, live.model, "free", meta))

    def _end(self, rid: str, error: str | None) -> None:
        """Abort a live request: free its KV on every stage, finish its stream ("abort")."""
        live = self._live.get(rid)
        if live is None:
            return
        if not live.held:
            self._free_everywhere(live)
        self._emit(rid, [], "abort", error)

    def _preempt(self, rid: str, error: str) -> None:
        """Stop a request to free KV (a stall): it restarts by recompute (paraflex/serving/recompute.py),
        or ends with `error` after MAX_RECOMPUTES restarts."""
        live = self._live.get(rid)
        if live is None:
            return
        with self._lock:
            stopped = self.restarts.stop(live)
        if not stopped:
            self._end(rid, error)
            return
        log.info("runtime: request %s stopped to free KV; it restarts by recompute after %d token(s)",
                 rid, live.tokens)
        self._free_everywhere(live)
        self._release((live.model, live.replica), ended=False)

    def _release(self, key: tuple[str, int], ended: bool) -> None:
        """Restart the held request of replica `key` that `to_release` names (on the next step:
        this may run inside an engine's step, through a sink)."""
        with self._lock:
            got = self.restarts.release(self._live, key, ended)
            if got is not None:
                rid, prompt, params = got
                self._inbox.append(("restart", rid, self._live[rid].engine_rid, prompt, params))

    def _break_stall(self) -> bool:
        """No engine can run anything and nothing travels between them: the live requests' KV
        fills the pools and the swap space, and only an end frees some. Stop the newest request
        holding KV on an engine that has queued work (else anywhere), as vLLM preempts its
        newest: its KV frees on every stage, the others go on, and it restarts by recompute;
        requests still waiting for their prompt hold none and wait. False when no request holds
        KV."""
        with self._lock:
            live = [(rid, lv.engine_rid) for rid, lv in self._live.items() if not lv.held]
        stuck = [e for e in self.engines if e.has_work()]
        rid = next((r for engines in (stuck, self.engines) for r, erid in reversed(live)
                    if self._holds_kv(erid, engines)), None)
        if rid is None:
            return False
        self._preempt(rid, stall_message(f"no engine could run any of the {len(live)} running requests "
                                         f"({self._stuck()})"))
        return True

    def _watch_stalls(self, now: float) -> None:
        """A replica stalled while others work (paraflex/serving/kv_stall.py): stop what the watch names."""
        with self._lock:
            replicas = live_by_replica(self.placement, self._live)
        runs = {e.engine_id: e.run_counts() for e in self.engines}
        for rid, error in self.stall_watch.check(now, runs, replicas):
            self._preempt(rid, error)

    def on_output(self, request_id, token_ids, finish_reason, error, **extra) -> None:
        """The engines' sink: forward to the request's own sink; drop output after the end (or
        of a run stopped for a restart)."""
        rid = self.restarts.client_of.get(request_id)
        if rid is not None:
            self._emit(rid, token_ids, finish_reason, error, **extra)

    def _emit(self, rid, token_ids, finish_reason, error, **extra) -> None:
        live = self._live[rid]
        live.output.extend(token_ids)
        if finish_reason is not None:
            with self._lock:
                del self._live[rid]
                self.restarts.end(live)
            self.dispatcher.done(live.model, live.replica)
            self._release((live.model, live.replica), ended=not live.held)
        if live.sink is not None:
            live.sink.on_output(rid, token_ids, finish_reason, error, **extra)


def _guarded(rid: str, end, *args) -> None:
    """`end(*args)`, logging instead of raising: one broken sink must not keep the others waiting."""
    try:
        end(*args)
    except Exception:  # noqa: BLE001
        log.exception("runtime: could not end request %s", rid)


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
