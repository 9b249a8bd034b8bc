"""An HTTP request body -> a validated protocol model (protocol.py), or an `ApiError` naming
what is wrong: 415 unless declared `application/json`, 413 past MAX_BODY_BYTES (counted as the body streams in), 400 for a body that is
not JSON Python can read (syntax, encoding, huge integers, deep nesting), not an object, holding
text with an unpaired UTF-16 surrogate, or failing the schema (the field path and the fix).

Place in the data flow: every POST route of app.py checks the media type and reads the body
here, then hands it to body_workers.py, which runs `decode` on the loop (small bodies) or in a
worker process (large ones).
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from paraflex.gateway.api_error import ApiError
from paraflex.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TextPart,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt is ~0.5 MB of text, ~1 MB as token ids

_FIELD_NAMES = {name for schema in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                                    ChatMessage, TextPart, StreamOptions) for name in schema.model_fields}


def _field_path(loc: tuple) -> str | None:
    """pydantic's error location as a field path (`messages[0].role`), minus union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _FIELD_NAMES or not path:
            path += f".{part}" if path else str(part)
        else:
            break
    return path or None


def validation_error(exc: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the field path (`messages[0].role`) and what to do."""
    err = exc.errors()[0]
    param = _field_path(tuple(err["loc"]))
    msg = {"extra_forbidden": "unknown field; this server does not implement it, remove it",
           "missing": "required field is missing"}.get(err["type"], err["msg"].removeprefix("Value error, "))
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param)


async def read_body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES before it is all read. A client that
    goes away meanwhile is logged in one line (its request ends there: nobody is left to answer)."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"request body is over {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_big
            parts.append(chunk)
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.warning("%s went away after sending %d of %s body bytes of %s %s", client, size, declared or "its",
                    request.method, request.url.path)
        raise ApiError(499, "the client closed the connection before sending the whole request body") from None
    return b"".join(parts)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # only unpaired surrogates fail
        return False
    return True


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether the JSON text `raw` can decode to a string with a UTF-16 surrogate: only through a
    \\uD800-\\uDFFF escape, or bytes that are not strict UTF-8 (json reads UTF-16/32 and encoded
    surrogates too). Both checks run in C; walking every value of an 8 MiB body in Python takes
    ~1 s."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _SURROGATE_ESCAPE.search(raw) is not None


def _surrogate_at(body) -> str | None:
    """Path of the first string (or key) holding an unpaired UTF-16 surrogate, e.g. a JSON
    "\\ud800" escape: such text cannot be encoded, so no tokenizer can read it."""
    stack = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                key_path = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path or "body"
                stack.append((key_path, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v) if isinstance(item, (str, list, dict)))
    return None


def decode(body: bytes, schema):
    """The JSON text `body` as a valid `schema` instance, or an ApiError naming what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad JSON/encoding, >4300-digit ints, deep nesting
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]
        raise ApiError(400, f"request body is not valid JSON ({detail})")
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    bad = _surrogate_at(data) if _may_hold_surrogates(body) else None
    if bad is not None:
        raise ApiError(400, f"{bad}: holds an unpaired UTF-16 surrogate (e.g. \\ud800); send valid Unicode text",
                       param=bad)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc)


def check_json_media_type(request: Request) -> None:
    """415 unless the body is declared `application/json`: a web page can POST `text/plain` (or
    form data) to any address without the browser asking the server first (CORS), never JSON."""
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"Content-Type: {declared or 'missing'}; send the body as JSON with "
                            "'Content-Type: application/json'")

