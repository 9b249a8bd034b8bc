"""Checks every request passes before it reaches a route: the `Host` header, the API key, and
whether the server still takes requests.

`HostCheck` answers 400 to a request whose `Host` is not a name of this server, so a web page
cannot reach a keyless server on loopback through DNS rebinding (its domain re-pointed at
127.0.0.1, the browser still sending that domain as `Host`). Accepted: `localhost`, any IP
address (rebinding needs a name), the names given (the bound `--host` and each
`--allowed-host`), or anything with `*`. `BearerAuth` answers 401 without
`Authorization: Bearer <key>` on every route but the open ones (`/health`, and `/metrics`
unless `--metrics-require-key`). `RefuseWhenClosed` answers 503 (`Retry-After`) to every
route but `/health` (which says so itself) and `/metrics` once the server is shutting down
(SIGTERM's drain window, server.py). All are pure ASGI middleware, so the routes' disconnect
detection still works. (The other half of the browser defence, JSON bodies only, is
request_body.py's 415.)

Place in the data flow: app.build_app wraps the routes in them, HostCheck outermost.
"""

from __future__ import annotations

import ipaddress
import secrets

from paraflex.gateway.api_error import ApiError


def _header(scope, name: bytes) -> bytes | None:
    """The header's value (the last one, if sent twice)."""
    return dict(scope["headers"]).get(name)


def _host_name(host: str) -> str:
    """The name in a Host header value: no port, no brackets' port, lower case, no final dot."""
    if host.startswith("["):
        name = host[:host.find("]") + 1] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0]
    return name.lower().rstrip(".")


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


class HostCheck:
    """400 for a `Host` that is not one of this server's names (see the module docstring)."""

    def __init__(self, app, allowed_hosts) -> None:
        self.app = app
        self.names = {_host_name(h) for h in allowed_hosts} | {"localhost"}

    def allows(self, host: str) -> bool:
        name = _host_name(host)
        return "*" in self.names or name in self.names or _is_ip_address(name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if host is not None and not self.allows(host.decode("latin-1")):
                name = _host_name(host.decode("latin-1"))
                response = ApiError(400, f"Host: {name!r} is not a name of this server; if clients reach it by "
                                         f"that name, start it with --allowed-host {name}").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BearerAuth:
    """401 without `Authorization: Bearer <api_key>` on every path but `open_paths`."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            scheme, _, key = (_header(scope, b"authorization") or b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(key, self.expected):
                response = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RefuseWhenClosed:
    """503 with `closed_reason()` on every path but `open_paths` while it is not None."""

    def __init__(self, app, closed_reason, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.closed_reason = closed_reason
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        reason = self.closed_reason() if scope["type"] == "http" else None
        if reason and scope["path"] not in self.open_paths:
            await ApiError(503, reason).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
