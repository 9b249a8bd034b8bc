"""The gateway's OpenAPI document (`GET /openapi.json`): what each route takes and answers.

FastAPI describes only the bodies it parses itself; the POST routes read theirs with
request_body.parse (for the 413, 415 and the error messages that name a field), so
`OpenApiDocument.json_body` declares each route's request schema (protocol.py) and the document
carries those schemas. Every route lists the errors it can answer with OpenAI's error body
(`ErrorBody`); FastAPI's 422, which this server never sends (the routes validate their bodies
themselves), is left out. Code generators and fuzzers can then reach the bodies from the served
schema alone (tests/paraflex/gateway/test_gateway_openapi.py runs schemathesis against it).

Place in the data flow: app.build_app makes one `OpenApiDocument`, declares its routes with
`json_body(...)` and `errors(...)`, and installs it as the app's `openapi`.
"""

from __future__ import annotations

import warnings

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

WHEN = {
    400: "a bad field (named in `param`), a body that is not a JSON object, a prompt too long for the "
         "context, or a Host header that is not a name of this server",
    401: "the API key is missing or wrong (`Authorization: Bearer <key>`)",
    403: "the route changes what the server runs and the server was started without an API key",
    404: "the model is not served here",
    408: "the request body stalled for the read timeout; the connection is closed",
    409: "the placement cannot fit the engines, cannot be applied live, or another change is under way",
    413: "the request body is over 8 MiB",
    415: "the body is not declared `Content-Type: application/json`",
    500: "an engine failed the request",
    503: "too many requests outstanding, no live replica of the model, or the server shutting down "
         "(`Retry-After` says when to try again)",
}


# The 200 of a generation route: JSON, or server-sent events with `stream: true`. Before
# OpenAPI 3.2 (`itemSchema`), the schema of an event-stream media type describes one event:
# its fields (`data` a JSON chunk or `[DONE]`), as client generators and schemathesis read it.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                              "id": {"type": "string"}, "retry": {"type": "integer"}}}
STREAMED = {200: {"description": "the completion, or with `stream: true` server-sent events ending in `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape (api_error.py)."""

    error: ErrorDetail


def _unique_operation_ids(doc: dict) -> None:
    """Suffix the method to an operation id already taken (OpenAPI wants them unique)."""
    seen = set()
    for operations in doc["paths"].values():
        for method, operation in operations.items():
            if operation["operationId"] in seen:
                operation["operationId"] += f"_{method}"
            seen.add(operation["operationId"])


class OpenApiDocument:
    """Collects the request schemas the routes declare and serves the finished document."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.request_schemas: list[type[BaseModel]] = []
        app.openapi = self.document

    def json_body(self, schema: type[BaseModel]) -> dict:
        """`openapi_extra` of a route whose body is a JSON `schema` (read by request_body.parse)."""
        self.request_schemas.append(schema)
        ref = {"$ref": f"#/components/schemas/{schema.__name__}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    @staticmethod
    def errors(*statuses: int) -> dict:
        """`responses` of a route that can answer `statuses` with OpenAI's error body (always JSON,
        also where the route's own response is not)."""
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        return {status: {"description": WHEN[status], "content": content} for status in statuses}

    def document(self) -> dict:
        if self.app.openapi_schema is None:
            with warnings.catch_warnings():  # a route of two methods (GET and HEAD /health) has one id
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                doc = get_openapi(title=self.app.title, version=self.app.version, routes=self.app.routes)
            _unique_operation_ids(doc)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(s, "validation") for s in [*self.request_schemas, ErrorBody]],
                                         ref_template="#/components/schemas/{model}")
            schemas.update(defs.get("$defs", {}))
            for operations in doc["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            self.app.openapi_schema = doc
        return self.app.openapi_schema
