"""One execution engine's main loop: receive -> the scheduler picks -> the worker runs -> send.

Place in the data flow (DESIGN.md "Engine"): an `EngineLoop` owns one engine-core
`EngineScheduler` (with its `BlockPool`), one torch `Worker` (the resident stages and the
shared `KVCache`) and one `Transport` endpoint. Each `step()`:

1. drains `transport.recv_ready()`: "batch" envelopes (a batch formed upstream plus its hidden
   states, parked by (batch id, stage) until the scheduler runs it), "token" envelopes (the
   last stage's sampled tokens, at a first stage) and "free" envelopes (finished / aborted);
2. asks the scheduler for the next batch and lets the worker run it (swap plan included);
3. non-last stage: sends the batch message and the hidden states to the next stage's engine;
   last stage: samples, checks stop rules, reports tokens to the `OutputSink`, sends the token
   message to the model's first stage and a free message to the model's other stages.

New requests enter at a first stage through `add_request` (the dispatcher picked this
replica). A stage joins (`add_stage`, its weights loaded elsewhere, e.g. on a loader thread)
or leaves (`remove_stage`) between steps while the other stages keep serving (live
re-planning); envelopes still travelling for a stage that left are dropped. Nothing here assumes the other engines share the process: they are reached only
through the `Transport` ABC, and clients only through the `OutputSink`, so the Ray actors
run this same class with their own transport.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from paraflex.engine.core.messages import BatchMessage, FreeMessage, TokenMessage
from paraflex.engine.core.sampling_params import SamplingParams, StopChecker
from paraflex.engine.worker.sampling import SampleResult, Sampler
from paraflex.engine.core.scheduled import BatchNeverFits
from paraflex.engine.transport.base import Envelope, Transport

log = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Receives a request's output as the last stage produces it.

    `token_ids` are the new tokens (one per call while decoding, empty on an error);
    `finish_reason` is None while running, then "stop", "length" or "abort"; `error` is a
    one-line message when the engine failed the request. `logprobs` (only passed when the
    request asked for them) holds one {"token", "logprob", "top"} dict per new token.
    """

    def on_output(self, request_id: str, token_ids: list[int], finish_reason: str | None,
                  error: str | None, **extra) -> None: ...


class EngineLoop:
    def __init__(self, engine_id: int, scheduler, worker, transport: Transport, sink: OutputSink,
                 routes: dict[str, list[int]], tokenizers: dict | None = None, seed: int = 0,
                 clock=time.monotonic) -> None:
        """routes[model]: the engine id of every stage of the replica this engine serves for
        `model`; tokenizers[model]: eos ids and decoding for the models whose last stage is here."""
        self.engine_id = engine_id
        self.scheduler = scheduler
        self.worker = worker
        self.transport = transport
        self.sink = sink
        self.routes = routes
        self.tokenizers = tokenizers or {}
        self.sampler = Sampler(seed + 7919 * engine_id)
        self.clock = clock
        self._parked: dict[tuple[str, int], tuple[torch.Tensor, list[str]]] = {}
        self._generated: dict[str, list[int]] = {}
        self._stoppers: dict[str, StopChecker] = {}
        self._params: dict[str, SamplingParams] = {}
        self.stats = {"batches": 0, "tokens": 0, "sampled": 0}
        self.last_run: tuple | None = None  # (batch, seconds of forward pass and sampling) of the last step that ran one
        # per resident model: batches [started, finished] (the KV-stall watch reads them from
        # another thread: a stage joining or leaving replaces the dict, never resizes it)
        self.runs: dict[str, list[int]] = {m: [0, 0] for m in routes}

    # ------------------------------------------------------------------ events in
    def add_request(self, model: str, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival: float | None = None) -> None:
        """A new request at this engine's first stage of `model`."""
        self.scheduler.add_request(
            request_id, model, len(prompt_token_ids), params.max_tokens,
            self.clock() if arrival is None else arrival,
            prompt_token_ids=list(prompt_token_ids), sampling=params.to_dict(),
        )

    # ------------------------------------------------------------------ resident stages
    def add_stage(self, model: str, stage: int, num_stages: int, route: list[int], weights_stage,
                  tokenizer=None) -> None:
        """Make stage `stage` of `model` (of `num_stages`; `weights_stage`: a worker `Stage` with
        its weights loaded) resident, on the replica whose stages run on `route`; `tokenizer`:
        eos ids and decoding when it is the last stage. Call between steps."""
        self.worker.add_stage(model, weights_stage)
        try:
            self.scheduler.add_stage(model, stage, weights_stage.num_layers,
                                     self.worker.kv_bytes_per_token_per_layer(model), num_stages)
        except BaseException:
            self.worker.remove_stage(model)
            raise
        self.routes[model] = list(route)
        if tokenizer is not None:
            self.tokenizers[model] = tokenizer
        self.runs = {**self.runs, model: [0, 0]}  # a new dict: run_counts may be reading the old one

    def remove_stage(self, model: str) -> list[str]:
        """Drop `model`'s stage: requests of it still here are aborted (their KV freed), its
        parked hidden states, weights and route go. Call between steps. Returns the ids aborted."""
        left = self.scheduler.remove_stage(model, abort_left=True)
        for rid in left:
            self._forget(rid)
        self._drop_dead_parked()  # its batches' requests are all gone now
        self.worker.remove_stage(model)
        self.routes.pop(model, None)
        self.tokenizers.pop(model, None)
        self.runs = {m: c for m, c in self.runs.items() if m != model}
        return left

    def handle(self, env: Envelope) -> None:
        if env.model not in self.routes:  # a stage that left this engine (live re-planning)
            log.debug("engine %d: dropped a %s envelope of %s, not resident here", self.engine_id, env.kind, env.model)
            return
        if env.kind == "batch":
            msg = BatchMessage.from_dict(env.meta)
            if self.scheduler.receive_batch(msg):  # else every request of it ended here already
                self._parked[(msg.batch_id, msg.stage)] = (env.tensors["hidden"], msg.req_ids)
        elif env.kind == "token":
            self.scheduler.receive_tokens(TokenMessage.from_dict(env.meta))
        else:
            msg = FreeMessage.from_dict(env.meta)
            self.scheduler.handle(msg)
            for rid in msg.req_ids:
                self._forget(rid)
            if msg.reason == "aborted":
                self._drop_dead_parked()

    def _drop_dead_parked(self) -> None:
        for key, (_, rids) in list(self._parked.items()):
            if all(self.scheduler.request(r) is None for r in rids):
                del self._parked[key]

    def _forget(self, rid: str) -> None:
        self._generated.pop(rid, None)
        self._stoppers.pop(rid, None)
        self._params.pop(rid, None)
        self.sampler.forget(rid)

    # ------------------------------------------------------------------ the loop
    def has_work(self) -> bool:
        return self.scheduler.has_ready_work()

    def step(self) -> bool:
        """Receive, then run at most one batch. True if a batch ran."""
        for env in self.transport.recv_ready():
            self.handle(env)
        try:
            batch = self.scheduler.schedule(self.clock())
        except BatchNeverFits as exc:  # its requests fail, not the engine
            log.error("%s", exc)
            for rid in exc.req_ids:
                self.scheduler.abort(rid)
                self.sink.on_output(rid, [], "abort", str(exc))
            self._broadcast_aborts(exc.model, exc.req_ids)
            self._drop_dead_parked()
            return True
        if batch is None:
            return False
        hidden = None
        if not batch.is_first:
            hidden, _ = self._parked.pop((batch.batch_id, batch.stage))
        count = self.runs[batch.model]
        count[0] += 1
        try:
            t0 = time.perf_counter()
            out = self.worker.run(batch, hidden)
            sampled = self._sample(batch, out) if batch.is_last else None
            self.last_run = (batch, time.perf_counter() - t0)
        except Exception as exc:  # a failed batch (forward pass or sampling) fails its requests, not the engine
            count[1] += 1
            log.exception("engine %d: batch %s failed", self.engine_id, batch.batch_id)
            self._fail(batch, f"{type(exc).__name__}: {exc}")
            return True
        count[1] += 1
        self.stats["batches"] += 1
        self.stats["tokens"] += batch.num_tokens
        if batch.is_last:
            self._finish_last(batch, *sampled)
        else:
            meta = batch.message
            meta.tensor_shapes = {"hidden": list(out.shape)}
            self._send(batch.model, batch.stage + 1, "batch", meta.to_dict(), {"hidden": out})
            done = self.scheduler.complete(batch)
            self._broadcast_aborts(batch.model, done.aborted)
        return True

    def run_counts(self) -> dict[str, tuple[int, int]]:
        """Per resident model (batches started, batches finished), safe to call from another
        thread: finished is read first, so a batch under way never looks finished."""
        out = {}
        for model, count in self.runs.items():
            finished = count[1]
            out[model] = (count[0], finished)
        return out

    def _sample(self, batch, logits: torch.Tensor) -> tuple[list, list[SamplingParams], SampleResult | None]:
        """(the requests that sample a token, their parameters, the sampler's result)."""
        sampling = [r for r in batch.requests if r.samples]
        params = [self._params_of(r) for r in sampling]
        result = self.sampler.sample(logits, [r.req_id for r in sampling], params) if sampling else None
        return sampling, params, result

    def _finish_last(self, batch, sampling: list, params: list[SamplingParams], result: SampleResult | None) -> None:
        tokens, stopped = {}, set()
        for i, r in enumerate(sampling):
            tok = result.token_ids[i]
            tokens[r.req_id] = tok
            gen = self._generated.setdefault(r.req_id, [])
            gen.append(tok)
            if self._stopper_of(batch.model, r.req_id, params[i]).check(gen) == "stop":
                stopped.add(r.req_id)
        done = self.scheduler.complete(batch, tokens=tokens, stopped=stopped)
        self.stats["sampled"] += len(sampling)
        msg = done.token_message
        for i, e in enumerate(msg.entries):
            extra = {}
            if result is not None and params[i].logprobs is not None:
                extra["logprobs"] = [result.logprobs[i]]
            self.sink.on_output(e.req_id, [e.token_id], e.reason if e.finished else None, None, **extra)
        self._send(batch.model, 0, "token", msg.to_dict())
        if done.finished:
            self._send_free(batch.model, done.finished, "finished")
            for rid in done.finished:
                self._forget(rid)
        self._broadcast_aborts(batch.model, done.aborted)

    def _fail(self, batch, error: str) -> None:
        for rid in batch.req_ids:
            self.scheduler.abort(rid)
        done = self.scheduler.complete(batch)
        for rid in batch.req_ids:
            self.sink.on_output(rid, [], "abort", error)
        self._broadcast_aborts(batch.model, list(dict.fromkeys(done.aborted + batch.req_ids)))

    def _broadcast_aborts(self, model: str, req_ids: list[str]) -> None:
        if req_ids:
            self._send_free(model, req_ids, "aborted")
            for rid in req_ids:
                self._forget(rid)

    def _params_of(self, r) -> SamplingParams:
        p = self._params.get(r.req_id)
        if p is None:
            p = self._params[r.req_id] = SamplingParams.from_dict(r.sampling or {})
        return p

    def _stopper_of(self, model: str, rid: str, params: SamplingParams) -> StopChecker:
        s = self._stoppers.get(rid)
        if s is None:
            tok = self.tokenizers.get(model)
            eos = tok.eos_token_ids if tok is not None else []
            decode = tok.decode if tok is not None else None
            s = self._stoppers[rid] = StopChecker(params, eos, decode)
        return s

    # ------------------------------------------------------------------ sending
    def _send(self, model: str, stage: int, kind: str, meta: dict, tensors=None) -> None:
        dst = self.routes[model][stage]
        if dst == self.engine_id and tensors is None:
            self.handle(Envelope(self.engine_id, dst, model, kind, meta))  # no hop to ourselves
            return
        self.transport.send(Envelope(self.engine_id, dst, model, kind, meta, tensors))

    def _send_free(self, model: str, req_ids: list[str], reason: str) -> None:
        meta = FreeMessage(model, list(req_ids), reason).to_dict()
        for stage, eid in enumerate(self.routes[model]):
            if eid != self.engine_id:
                self._send(model, stage, "free", meta)
