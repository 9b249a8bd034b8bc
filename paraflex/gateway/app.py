"""The OpenAI-compatible HTTP API (FastAPI): the front door of `paraflex serve`.

Data flow: client JSON -> request_body.py (413 over 8 MiB, 415) -> body_workers.py, off the
event loop: protocol.py schema (400 naming a bad field) -> request_prep.py: model lookup (404)
-> tokenize (chat template for chat) -> context check (400) -> admission (503 when too many
requests are outstanding) -> generation.generate over the Backend -> OpenAI JSON, or SSE
chunks ending in `data: [DONE]`. Non-streaming requests watch for the client going away and
abort in the backend; streaming requests are cancelled by Starlette on disconnect and abort
in generation.generate's cleanup. Routes: /v1/models, /v1/completions,
/v1/chat/completions, /tokenize, /detokenize, /health, /metrics, GET/POST /v1/placement
(placement_routes.py) (and /openapi.json, openapi.py). Before any route, guards.py checks the
`Host` header (400), refuses new requests once the server is shutting down (503), and, with
an API key, checks `Authorization: Bearer <key>` on every route except /health and /metrics
(401; /metrics too with metrics_require_key).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paraflex.gateway.api_error import ApiError
from paraflex.serving.backend import Backend, ModelCard
from paraflex.serving.request_log import HTTP_ARRIVAL
from paraflex.gateway.generation import Admission, Chunk, Running, Ticket, generate
from paraflex.gateway.guards import BearerAuth, HostCheck, RefuseWhenClosed
from paraflex.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from paraflex.gateway.openapi import STREAMED, OpenApiDocument
from paraflex.gateway.placement_routes import add_placement_routes
from paraflex.gateway.body_workers import BodyWorkers
from paraflex.gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, StreamOptions, TokenizeRequest
from paraflex.gateway.request_body import check_json_media_type, read_body
from paraflex.gateway.request_prep import card_of, param_of


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _model_entry(card: ModelCard, created: int) -> dict:
    return {"id": card.name, "object": "model", "created": created, "owned_by": "paraflex",
            "root": card.name, "parent": None, "max_model_len": card.max_context}


class _TicketedStream(StreamingResponse):
    """An SSE response that releases its admission ticket however the response ends."""

    def __init__(self, content, ticket: Ticket):
        super().__init__(content, media_type="text/event-stream")
        self._ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ticket.release()


SHUTTING_DOWN = "server shutting down; send the request again (to another server)"


class Gateway:
    """Route handlers bound to one backend."""

    def __init__(self, backend: Backend, max_outstanding: int, arrival_rates=None):
        self.backend = backend
        self.cards: dict[str, ModelCard] = {c.name: c for c in backend.models()}
        self.metrics = GatewayMetrics(list(self.cards), arrival_rates)
        self.admission = Admission(max_outstanding)
        self.created = int(time.time())
        self.running = Running()  # generation.generate keeps it
        self.body_workers = BodyWorkers(self.cards)  # closed by server.py when the server stops

    def stop_admitting(self) -> None:
        """The server is about to shut down (SIGTERM's drain window, server.py): /health answers
        503 and new requests 503 with Retry-After (also those admitted whose stream has not
        started); running requests go on."""
        self.running.closed = SHUTTING_DOWN

    def closed_reason(self) -> str | None:
        """Why new requests are refused (503), or None while the server takes them."""
        return self.running.closed

    async def drain(self) -> None:
        """The server is shutting down: refuse new requests (`stop_admitting`) and end every
        running one with an explicit error, freed on the engines, so each stream ends with an
        error event and [DONE] and each blocking request with a 503 before the connections close."""
        self.stop_admitting()
        for rid in list(self.running.ids):
            await self.backend.abort(rid, error=SHUTTING_DOWN)

    def card(self, name: str) -> ModelCard:
        return card_of(self.cards, name)

    async def prepare(self, request: Request, schema):
        """The POST body of `request` decoded as `schema` and prepared for its route
        (request_prep.py), off the event loop (body_workers.py); an ApiError if it cannot run."""
        check_json_media_type(request)
        return await self.body_workers.prepare(await read_body(request), schema)

    def admit(self) -> Ticket:
        if self.running.closed:
            raise ApiError(503, self.running.closed)
        ticket = self.admission.enter()
        if ticket is None:
            raise ApiError(503, f"server overloaded: {self.admission.outstanding} requests outstanding "
                           f"(limit {self.admission.limit}); retry later")
        return ticket

    # -- running -------------------------------------------------------------------------

    async def collect(self, request: Request, ticket: Ticket, card, ids, params, rid) -> tuple[str, Chunk]:
        """Run to completion, aborting if the client disconnects meanwhile."""
        parts: list[str] = []
        last = Chunk("")
        gen = generate(self.backend, self.metrics, card, ids, params, rid, self.running)

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)
            await self.backend.abort(rid)

        watcher = asyncio.create_task(watch())
        try:
            async for chunk in gen:
                parts.append(chunk.text)
                last = chunk
        finally:
            watcher.cancel()
            await gen.aclose()
            ticket.release()
        if last.rejected:
            raise ApiError(400, last.error, param=param_of(last.error))
        if last.unavailable:
            raise ApiError(503, last.error)
        if last.error:
            raise ApiError(503 if last.error == SHUTTING_DOWN else 500, f"generation failed: {last.error}")
        return "".join(parts), last

    def usage(self, n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def sse(self, chunks: AsyncIterator[Chunk], make_choice, head: dict, n_prompt: int,
                  options: StreamOptions | None, first_choice=None) -> AsyncIterator[str]:
        """SSE events; with include_usage every chunk has `usage` (null, or the running count
        with continuous_usage_stats) and a last chunk carries the totals. `first_choice` (chat's
        role chunk) goes out with the first output, as vLLM sends it: clients that time the first
        token by the first chunk (`vllm bench serve`) read the TTFT, not the arrival."""
        include = bool(options and options.include_usage)
        running = bool(include and options.continuous_usage_stats)

        def usage_field(n_out: int) -> dict:
            if not include:
                return {}
            return {"usage": self.usage(n_prompt, n_out) if running else None}

        last = Chunk("")
        try:
            async for chunk in chunks:
                last = chunk
                if chunk.error:
                    kind = ("invalid_request_error" if chunk.rejected else "service_unavailable" if chunk.unavailable
                            else "server_error")
                    msg = chunk.error if chunk.rejected or chunk.unavailable else f"generation failed: {chunk.error}"
                    yield _sse({"error": {"message": msg, "type": kind, "param": None, "code": None}})
                    break
                if first_choice is not None:
                    yield _sse({**head, "choices": [first_choice], **usage_field(0)})
                    first_choice = None
                if chunk.text or chunk.finish_reason:
                    yield _sse({**head, "choices": [make_choice(chunk)], **usage_field(chunk.completion_tokens)})
            if include and not last.error:
                yield _sse({**head, "choices": [], "usage": self.usage(n_prompt, last.completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()


def build_app(backend: Backend, *, api_key: str | None = None, max_outstanding: int = 256,
              allowed_hosts: tuple[str, ...] = (), metrics_require_key: bool = False,
              arrival_rates=None) -> FastAPI:
    """The FastAPI app serving `backend`. max_outstanding: admitted requests before 503;
    allowed_hosts: `Host` names accepted besides localhost and IP addresses ("*": any; guards.py);
    metrics_require_key: /metrics too needs the API key (only /health stays open); arrival_rates:
    the meter told of every admitted request and shown as paraflex:arrival_rate (default the
    gateway's own `ArrivalRates`; the live re-planner with `--replan-interval`)."""
    gw = Gateway(backend, max_outstanding, arrival_rates)
    app = FastAPI(title="ParaFlex", docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        what = {404: f"no route {request.url.path}; see GET /v1/models, POST /v1/completions, "
                     "/v1/chat/completions, /tokenize, /detokenize, GET /health, /metrics, GET/POST /v1/placement",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, what, headers=exc.headers).response()  # 405's Allow

    doc = OpenApiDocument(app)

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key,
                           open_paths=("/health",) if metrics_require_key else ("/health", "/metrics"))
    app.add_middleware(RefuseWhenClosed, closed_reason=gw.closed_reason, open_paths=("/health", "/metrics"))
    app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)  # added last: runs first

    @app.get("/v1/models", responses=doc.errors(400, 401, 503))
    async def list_models():
        return {"object": "list", "data": [_model_entry(c, gw.created) for c in gw.cards.values()]}

    @app.get("/v1/models/{model_id:path}", responses=doc.errors(400, 401, 404, 503))
    async def retrieve_model(model_id: str):
        card = gw.card(model_id)
        return _model_entry(card, gw.created)

    @app.post("/v1/completions", openapi_extra=doc.json_body(CompletionRequest),
              responses={**STREAMED, **doc.errors(400, 401, 404, 408, 413, 415, 500, 503)})
    async def completions(request: Request):
        HTTP_ARRIVAL.set(time.time())  # for `--request-log` (the gateway's share of each request)
        job = await gw.prepare(request, CompletionRequest)
        card = gw.cards[job.model]
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": card.name}
        ticket = gw.admit()
        if job.stream:
            chunks = generate(gw.backend, gw.metrics, card, job.ids, job.params, rid, gw.running)

            def choice(c: Chunk) -> dict:
                return {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            return _TicketedStream(gw.sse(chunks, choice, head, len(job.ids), job.stream_options), ticket)
        text, last = await gw.collect(request, ticket, card, job.ids, job.params, rid)
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": last.finish_reason}],
                "usage": gw.usage(len(job.ids), last.completion_tokens)}

    @app.post("/v1/chat/completions", openapi_extra=doc.json_body(ChatCompletionRequest),
              responses={**STREAMED, **doc.errors(400, 401, 404, 408, 413, 415, 500, 503)})
    async def chat_completions(request: Request):
        HTTP_ARRIVAL.set(time.time())  # for `--request-log` (the gateway's share of each request)
        job = await gw.prepare(request, ChatCompletionRequest)
        card = gw.cards[job.model]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": card.name}
        ticket = gw.admit()
        if job.stream:
            chunks = generate(gw.backend, gw.metrics, card, job.ids, job.params, rid, gw.running)

            def choice(c: Chunk) -> dict:
                return {"index": 0, "delta": {"content": c.text} if c.text else {}, "logprobs": None,
                        "finish_reason": c.finish_reason}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            return _TicketedStream(gw.sse(chunks, choice, head, len(job.ids), job.stream_options, first), ticket)
        text, last = await gw.collect(request, ticket, card, job.ids, job.params, rid)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": gw.usage(len(job.ids), last.completion_tokens)}

    @app.post("/tokenize", openapi_extra=doc.json_body(TokenizeRequest),
              responses=doc.errors(400, 401, 404, 408, 413, 415, 503))
    async def tokenize(request: Request):
        rendered = await gw.prepare(request, TokenizeRequest)
        return Response(rendered.body, media_type="application/json")

    @app.post("/detokenize", openapi_extra=doc.json_body(DetokenizeRequest),
              responses=doc.errors(400, 401, 404, 408, 413, 415, 503))
    async def detokenize(request: Request):
        rendered = await gw.prepare(request, DetokenizeRequest)
        return Response(rendered.body, media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"], responses={
        503: {"description": "an engine has failed (`ok` false), or the server is shutting down (`shutting_down` true)",
              "content": {"application/json": {"schema": {"type": "object"}}}}, **doc.errors(400)})
    async def health():
        state = gw.backend.health()
        if gw.closed_reason():
            state = {**state, "ok": False, "shutting_down": True}
        return JSONResponse(state, status_code=200 if state.get("ok") else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=doc.errors(400, 401))
    async def metrics():
        return PlainTextResponse(gw.metrics.render(gw.backend.metrics()),
                                 media_type=CONTENT_TYPE)

    add_placement_routes(app, backend, api_key, doc)

    return app
