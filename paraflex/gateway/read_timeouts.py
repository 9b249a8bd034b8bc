"""How long a client may take to send a request: the gateway's header and body read timeouts.

A request's headers must arrive whole within `seconds` of its first byte (for a new
connection, of the connection opening): a client sending its headers slowly (1 byte a second)
is disconnected. A request body may stall at most `seconds` between two reads: the request is
answered 408 and the connection closed (a client that announced `Content-Length: 100` and sent
7 bytes used to hold its connection and request for ever). Each is logged as one line.

Place in the data flow: server.py hands uvicorn `HeaderTimeoutH11` as its HTTP/1.1 protocol
(uvicorn reads headers before the app sees anything, so only the protocol can time them) and
the app wrapped in `BodyReadTimeout`, whose 408 the app's `ApiError` handler answers.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from paraflex.gateway.api_error import ApiError

log = logging.getLogger(__name__)


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not all in within
    `header_timeout` seconds of their first byte. Keep-alive idling between requests is left to
    uvicorn's `timeout_keep_alive`."""

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_deadline: asyncio.TimerHandle | None = None
        self.header_bytes = 0  # bytes of the request whose headers are awaited

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_header_clock()

    def connection_lost(self, exc) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are in
            self._stop_header_clock()
        elif self.cycle is None or self.cycle.response_complete:  # (part of) the next request's headers
            self.header_bytes += len(data)
            if self.header_deadline is None:
                self._start_header_clock()

    def _start_header_clock(self) -> None:
        if not self.transport.is_closing():
            self.header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_clock(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        self.header_deadline, self.header_bytes = None, 0

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing():
            return
        if self.header_bytes:  # a connection opened and never used closes without a word
            log.warning("closed the connection of %s: its request headers were not complete %g s after they "
                        "began (%d bytes)", _peer(self.client), self.header_timeout, self.header_bytes)
        self.transport.close()


class BodyReadTimeout:
    """ASGI wrapper: a request body that stalls `seconds` between two reads ends the request
    with a 408 (`ApiError`, raised where the app reads the body) and closes the connection."""

    def __init__(self, app, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.seconds)
            except asyncio.TimeoutError:
                log.warning("answered 408 to %s: its request body (%s %s) stalled for %g s", _peer(scope.get("client")),
                            scope["method"], scope["path"], self.seconds)
                raise ApiError(408, f"request body incomplete: nothing arrived for {self.seconds:g} s; send the "
                                    "whole body (as many bytes as Content-Length says)") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)
