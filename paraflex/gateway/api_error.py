"""The gateway's error responses: `ApiError` carries an HTTP status, a message naming the field
at fault and the fix, and OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.

Place in the data flow: request parsing (request_body.py), the body read timeout
(read_timeouts.py), the request guards (guards.py) and the routes (app.py) raise it or send
its response; the app's exception handler turns it into the JSON response, so the `openai`
client raises its typed exceptions.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An OpenAI-style error response; `headers` are sent with it (405's `Allow`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        super().__init__(message)

    def __reduce__(self):  # pickled by its fields: it comes back from body_workers.py's processes
        return ApiError, (self.status, self.message, self.param, self.code, self.headers)

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 503:
            headers["Retry-After"] = "1"
        if self.status == 408:  # the client is still sending the request: end the connection
            headers["Connection"] = "close"
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 503: "service_unavailable"}.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers or None)
