"""The serving frontend: the control logic both engine backends share.

Place in the data flow: between whoever takes a request (the gateway's `Backend`, or
`LLMCluster.submit`) and the engines. `admit` checks it (paraflex/serving/admission.py); `start`
dispatches it to a live replica of its model by the config's dispatch rule (home-first or
least outstanding: the engine core's `Dispatcher`) and submits it to that replica's first-stage engine through the
`EngineHandles` (paraflex/serving/engine_handle.py: engines in this process, or Ray actors). The
last stage's outputs come back through `on_output`, are mapped from the engine request id to the
client's, and go to the request's sink. `end` aborts a request (its KV freed on every stage of
its replica); `preempt` stops one to free KV in a stall and restarts it by recompute
(paraflex/serving/recompute.py) once its replica can take it back; `watch_stalls` hands the
KV-stall watch (paraflex/serving/kv_stall.py) the engines' batch counts and stops what it names;
`mark_down` / `mark_up` take an engine's replicas out of dispatch (failing their requests) and
back; `fail_all` ends every request with one error. During a live placement change
(paraflex/serving/live_placement.py) `add_replica` puts a replica whose stages are all loaded into
dispatch, `retire_replica` takes one out (its requests go on: it drains), `move_off` restarts
what is left on it by recompute on the model's other replicas, `drop_replica` forgets it, and
`install` makes the new placement the serving one (placement_edit.py makes the states between).

With a `request_log` (paraflex/serving/request_log.py, `paraflex serve --request-log`), every
request's start, tokens and end are recorded there.

A sink is any object with `on_output(request_id, token_ids, finish_reason, error, **extra)`
(the engines' `OutputSink` shape), called with the client's request id: new tokens while the
request runs, then one call with finish_reason "stop", "length" or "abort" (an end here, or an
engine's failure, carries `error` too).

Threads: every method may be called from any thread. One lock guards the live requests, the
restart books, the dispatcher and the engines' liveness; the engine handles are called under it
(see engine_handle.py), sinks outside it. Pure logic: no torch, Ray or HTTP.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.errors import ParaflexError, UserError
from paraflex.serving.admission import check_request, max_model_len
from paraflex.serving.backend import Unavailable
from paraflex.serving.engine_handle import EngineHandles
from paraflex.serving.kv_stall import StallWatch, live_by_replica
from paraflex.serving.placement_edit import replica_index, with_replica, without_replica
from paraflex.serving.recompute import Restartable, Restarts, held_by_model

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ClientRequest(Restartable):
    """A live request as the frontend keeps it: what a restart needs, and where its output goes."""

    sink: object  # see the module docstring; None: nobody listens


class Frontend:
    """Admission, dispatch, output routing, ends, restarts and stall stops over `EngineHandles`."""

    def __init__(self, config, placement, engines: EngineHandles, report: Callable[[str], None],
                 kv_limits: dict | None = None) -> None:
        """report: told one line of text when a request is stopped or an engine goes down;
        kv_limits: `admission.kv_limits_by_model` of the engines (a backend whose engines report
        later sets `kv_limits` then)."""
        self.config = config
        self.placement = placement
        self.engines = engines
        self.report = report
        self.kv_limits = kv_limits or {}
        self.live: dict[str, ClientRequest] = {}  # by the client's request id, oldest first
        self.restarts = Restarts()  # engine request ids, stops per model (paraflex/serving/recompute.py)
        self.dispatcher = Dispatcher.from_placement(placement, config)
        self.down: dict[int, str] = {}  # engine id -> why it is out of service
        self.retiring: set[tuple[str, tuple[int, ...]]] = set()  # (model, engines): out of dispatch, draining
        self.stall_watch = StallWatch()
        self.request_log = None  # a RequestLog, set by `paraflex serve --request-log`
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ admission and start
    def admit(self, model: str, prompt_token_ids, params) -> tuple[list[int], object]:
        """(the prompt as a list of ints, the validated params), or `UserError` naming what is
        wrong (paraflex/serving/admission.py)."""
        params = params.validate()
        return check_request(self.config, self.placement, self.kv_limits, model, prompt_token_ids,
                             params.max_tokens), params

    def max_model_len(self, model: str) -> int:
        """The longest request (prompt + max_tokens) of `model` its engines can hold."""
        return max_model_len(self.config, self.kv_limits, model)

    def in_use(self, rid: str) -> bool:
        """Whether `rid` names a live request or one of its engine requests."""
        with self.lock:
            return self.restarts.in_use(rid, self.live)

    def start(self, rid: str, model: str, prompt: list[int], params, sink) -> None:
        """Dispatch an admitted request to a live replica and submit it to its first stage.
        `UserError` when `rid` is in use, `Unavailable` when no replica of `model` is live."""
        with self.lock:
            if self.restarts.in_use(rid, self.live):
                raise UserError(f"request_id: {rid!r} is already in use")
            replica = self._pick_live(model)
            if replica is None:
                raise Unavailable(f"model {model!r} has no live replica: {self._down_summary()}; retry later")
            rec = ClientRequest(model=model, replica=replica, prompt=prompt, params=params, engine_rid=rid,
                                sink=sink)
            self.live[rid] = rec
            self.restarts.begin(rid)
            if self.request_log is not None:
                self.request_log.started(rid, model, replica, len(prompt), params.max_tokens)
            self._submit(rec, prompt, params)

    # ------------------------------------------------------------------ outputs and ends
    def on_output(self, engine_rid: str, token_ids, finish_reason, error, **extra) -> None:
        """An engine's output record: to the request's sink; dropped after the end (or of a run
        stopped for a restart)."""
        final = finish_reason is not None or error is not None
        with self.lock:
            rid = self.restarts.client_of.get(engine_rid)
            if rid is None:
                return
            if self.request_log is not None:
                self.request_log.tokens(rid, len(token_ids))
                if final and error is None and finish_reason != "abort":
                    self.request_log.finished(rid)
            rec = self._forget(rid) if final else self.live[rid]
            rec.output.extend(token_ids)
        if rec.sink is not None:
            rec.sink.on_output(rid, token_ids, finish_reason, error, **extra)
        if final:
            self._release(rec.model, rec.replica, ended=True)

    def end(self, rid: str, error: str | None = None, notify: bool = True) -> None:
        """Abort a live request: free its KV on every stage, finish its stream ("abort", with
        `error` if given; no call to its sink when not `notify`). Unknown ids are ignored."""
        with self.lock:
            rec = self._forget(rid)
            if rec is None:
                return
            if not rec.held:
                self._free(rec.model, rec.replica, [rec.engine_rid])
        if notify and rec.sink is not None:
            rec.sink.on_output(rid, [], "abort", error)
        self._release(rec.model, rec.replica, ended=not rec.held)

    def fail_all(self, error: str) -> None:
        """End every live request with `error` (the engines are gone: nothing to free)."""
        with self.lock:
            ended = [(rid, self._forget(rid)) for rid in list(self.live)]
        for rid, rec in ended:
            end_quietly(rid, rec.sink, error)

    # ------------------------------------------------------------------ restarts by recompute
    def preempt(self, rid: str, error: str) -> None:
        """Stop a request to free KV (a stall): it restarts by recompute (paraflex/serving/recompute.py),
        or ends with `error` after MAX_RECOMPUTES restarts."""
        with self.lock:
            rec = self.live.get(rid)
            if rec is None:
                return
            held = self.restarts.stop(rec)
            if held:  # freed under the lock: a restart (which takes it) cannot rename it meanwhile
                self._free(rec.model, rec.replica, [rec.engine_rid])
                tokens = rec.tokens
        if not held:
            self.end(rid, error)
            return
        self.report(f"request {rid} stopped to free KV; it restarts by recompute after {tokens} token(s)")
        self._release(rec.model, rec.replica, ended=False)

    def _release(self, model: str, replica: int, ended: bool) -> None:
        """Restart the held request of the replica that `to_release` names. Submitted under the
        lock, so an end of it (which takes the lock first) reaches the engines after it."""
        with self.lock:
            if not self._replica_alive(model, replica):
                return
            got = self.restarts.release(self.live, (model, replica), ended)
            if got is not None:
                rid, prompt, params = got
                self._submit(self.live[rid], prompt, params)

    def watch_stalls(self, now: float, runs: dict) -> None:
        """Hand the KV-stall watch (paraflex/serving/kv_stall.py) the engines' batch counts
        (`runs`: engine -> its `run_counts()`, None when not fresh) and the live requests per
        replica; stop the requests it names."""
        with self.lock:
            replicas = live_by_replica(self.placement, self.live)
        for rid, error in self.stall_watch.check(now, runs, replicas):
            self.preempt(rid, error)

    # ------------------------------------------------------------------ engine liveness
    def mark_down(self, engine: int, reason: str) -> None:
        """Take `engine` out of service: its replicas leave dispatch, and every request on them
        ends with `reason`, freed on the replica's other engines (no-op when already down)."""
        with self.lock:
            if engine in self.down:
                return
            self.down[engine] = reason
            hit = [(rid, rec) for rid, rec in self.live.items() if engine in self._engines_of(rec)]
            by_replica: dict[tuple[str, int], list[str]] = {}
            for rid, rec in hit:
                self._forget(rid)
                if not rec.held:
                    by_replica.setdefault((rec.model, rec.replica), []).append(rec.engine_rid)
            for (model, replica), rids in by_replica.items():
                self._free(model, replica, rids)
        self.report(f"{reason}; failing {len(hit)} request(s) on its replicas")
        for rid, rec in hit:
            if rec.sink is not None:
                rec.sink.on_output(rid, [], "abort", reason)

    def mark_up(self, engine: int) -> None:
        """`engine` serves again: its replicas rejoin dispatch."""
        with self.lock:
            self.down.pop(engine, None)

    def down_engines(self) -> dict[int, str]:
        """Engine id -> why it is out of service."""
        with self.lock:
            return dict(self.down)

    def live_replicas(self, model: str) -> int:
        """How many replicas of `model` have every engine in service."""
        with self.lock:
            return sum(self._replica_alive(model, j) for j in range(len(self.placement.models[model].replicas)))

    # ------------------------------------------------------------------ live placement changes
    def add_replica(self, model: str, engines: list[int]) -> None:
        """A replica of `model` whose stages are all loaded on `engines` joins dispatch."""
        with self.lock:
            self.placement = with_replica(self.placement, model, engines)
            self.dispatcher.add_replica(model, list(engines))

    def retire_replica(self, model: str, engines: list[int]) -> None:
        """`model`'s replica on `engines` takes no new request; its requests go on (it drains)."""
        with self.lock:
            self.retiring.add((model, tuple(engines)))

    def requests_on(self, model: str, engines: list[int]) -> int:
        """Live requests (held ones too) of `model`'s replica on `engines`."""
        with self.lock:
            j = replica_index(self.placement, model, engines)
            return sum(rec.model == model and rec.replica == j for rec in self.live.values())

    def move_off(self, model: str, engines: list[int], why: str) -> int:
        """Restart every request left on a retiring replica by recompute on another live replica
        of `model` (from the tokens it has, as a KV-stall stop does, without counting as one);
        one with nowhere to go ends with `why`. Returns how many moved."""
        moved: dict[str, int] = {}
        ended = []
        with self.lock:
            j = replica_index(self.placement, model, engines)
            for rid, rec in list(self.live.items()):
                if rec.model != model or rec.replica != j:
                    continue
                target = self._pick_live(model)
                if target is None:
                    ended.append((rid, self._forget(rid)))
                    if not rec.held:
                        self._free(model, j, [rec.engine_rid])
                    continue
                if not rec.held:
                    self._free(model, j, [rec.engine_rid])
                self.dispatcher.done(model, j)
                rec.replica = target
                moved[rid] = target
                if not rec.held:
                    self._submit(rec, *self.restarts.move(rid, rec, self.live))
        for rid, rec in ended:
            end_quietly(rid, rec.sink, why)
        for target in set(moved.values()):  # a held request there may restart now
            self._release(model, target, ended=False)
        if moved:
            self.report(f"{len(moved)} request(s) of {model} moved off its replica on engines {list(engines)}; "
                        "they restart by recompute")
        return len(moved)

    def drop_replica(self, model: str, engines: list[int]) -> None:
        """A drained replica of `model` leaves the serving placement."""
        with self.lock:
            j = replica_index(self.placement, model, engines)
            if any(rec.model == model and rec.replica == j for rec in self.live.values()):
                raise ParaflexError(f"replica of {model} on engines {list(engines)} still has requests")
            self.placement = without_replica(self.placement, model, j)
            self.dispatcher.remove_replica(model, j)
            for rec in self.live.values():
                if rec.model == model and rec.replica > j:
                    rec.replica -= 1
            self.retiring.discard((model, tuple(engines)))

    def install(self, placement) -> None:
        """The change is complete: `placement`, with the same replicas as the serving one (in
        any order), becomes the serving placement; live requests keep their replicas."""
        with self.lock:
            orders = {}
            for model, m in placement.models.items():
                order = [replica_index(self.placement, model, r) for r in m.replicas]
                if None in order or len(order) != len(self.placement.models[model].replicas):
                    raise ParaflexError(f"install: the replicas of {model} differ from the serving placement's")
                orders[model] = order
            for model, order in orders.items():
                self.dispatcher.reorder(model, order)
                new_of = {old: new for new, old in enumerate(order)}
                for rec in self.live.values():
                    if rec.model == model:
                        rec.replica = new_of[rec.replica]
            self.placement = placement

    # ------------------------------------------------------------------ numbers
    def is_live(self, rid: str) -> bool:
        with self.lock:
            return rid in self.live

    def has_live(self) -> bool:
        with self.lock:
            return bool(self.live)

    def running_engine_ids(self) -> list[tuple[str, str]]:
        """(client id, engine id) of every live request not held for a restart, oldest first."""
        with self.lock:
            return [(rid, rec.engine_rid) for rid, rec in self.live.items() if not rec.held]

    def running_by_model(self) -> dict[str, int]:
        """Per model: live requests not held for a restart."""
        with self.lock:
            out: dict[str, int] = {}
            for rec in self.live.values():
                if not rec.held:
                    out[rec.model] = out.get(rec.model, 0) + 1
            return out

    def held(self) -> dict[str, int]:
        """Per model: requests stopped to free KV, waiting for their replica to restart them."""
        with self.lock:
            return held_by_model(self.live.values())

    def preemptions(self) -> dict[str, int]:
        """Per model: requests stopped to free KV so far (vLLM's num_preemptions)."""
        with self.lock:
            return dict(self.restarts.preemptions)

    # ------------------------------------------------------------------ internals (lock held)
    def _engines_of(self, rec: ClientRequest) -> list[int]:
        return self.placement.models[rec.model].replicas[rec.replica]

    def _replica_alive(self, model: str, replica: int) -> bool:
        return not any(e in self.down for e in self.placement.models[model].replicas[replica])

    def _pick_live(self, model: str) -> int | None:
        """Least outstanding among the live replicas not retiring (None when none is)."""
        replicas = self.placement.models[model].replicas
        live = [j for j in range(len(replicas))
                if self._replica_alive(model, j) and (model, tuple(replicas[j])) not in self.retiring]
        return self.dispatcher.pick(model, among=live)

    def _down_summary(self) -> str:
        return "; ".join(f"engine {e} dead ({why})" for e, why in sorted(self.down.items())) or "no engine is down"

    def _submit(self, rec: ClientRequest, prompt: list[int], params) -> None:
        first = self._engines_of(rec)[0]
        self.engines.add_request(first, rec.model, rec.engine_rid, prompt, params)

    def _free(self, model: str, replica: int, engine_rids: list[str]) -> None:
        for e in self.placement.models[model].replicas[replica]:
            if e not in self.down:
                self.engines.free(e, model, engine_rids)

    def _forget(self, rid: str) -> ClientRequest | None:
        """Drop a live request from the books and release its dispatch slot."""
        rec = self.live.pop(rid, None)
        if rec is not None:
            if self.request_log is not None:
                self.request_log.dropped(rid)  # (no-op once `finished` wrote it)
            self.dispatcher.done(rec.model, rec.replica)
            self.restarts.end(rec)
        return rec


def end_quietly(rid: str, sink, error: str) -> None:
    """Tell `sink` that request `rid` ended with `error`, logging instead of raising: one broken
    sink must not keep the others waiting."""
    if sink is None:
        return
    try:
        sink.on_output(rid, [], "abort", error)
    except Exception:  # noqa: BLE001
        log.exception("serving: could not end request %s", rid)
